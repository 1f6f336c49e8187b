"""One KV arena shared by several models' engines: uniform byte pages with per-model tokens, one page
budget, eviction across models, and a device's rows never read or written for another device."""
import ctypes
import dataclasses
import math
import mmap
import os
import re
import sys
import warnings

import jax
import numpy as np
import pytest

from talaria_jax.engine.engine import Engine, EngineConfig, StepError
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.kvcache import pool
from talaria_jax.kvcache.host_tier import HostTier
from talaria_jax.kvcache.pool import KVArena, buffer_pointers, read_kv, write_kv
from talaria_jax.models import greedy_generate, init_model, load_model_config
from talaria_jax.sharding import make_mesh

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# `make test` requires the compiled extensions (TALARIA_REQUIRE_NATIVE=1): a failed build fails, not skips
REQUIRE_NATIVE = os.environ.get("TALARIA_REQUIRE_NATIVE") == "1"
CONFIG = EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=64, max_model_len=256, warmup=False,
                      prefix_cache=True)


def small(**kw):
    return dataclasses.replace(load_model_config("tiny-dense"), name="tiny-small", **kw)


@pytest.fixture(scope="module")
def pair():
    """On 4 devices: A splits its 4 kv heads one per device; B's 2 kv heads are replicated on every
    device, and it has half the layers, so a page holds other bytes of each on each device."""
    mesh = make_mesh(jax.devices()[:4])
    return (init_model(load_model_config("tiny-dense"), mesh, seed=1),
            init_model(small(num_layers=2, num_kv_heads=2, hidden_size=128), mesh, seed=2))


def prompt(seed: int, n: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, 256, n).tolist()


def test_pages_are_uniform_in_bytes_and_hold_each_models_tokens():
    mesh = make_mesh(jax.devices()[:4])
    fat, thin = load_model_config("tiny-dense"), small(num_layers=2, num_kv_heads=4)
    arena = KVArena.for_models([fat, thin], mesh, 8, num_pages=10)
    # a token of tiny-dense takes 2 x 4 layers x 1 kv head x 32 per device; the thin one half of that
    assert arena.words == 8 * 2 * 4 * 32
    a, b = arena.spec_for(fat), arena.spec_for(thin)
    assert (a.page_size, a.rows) == (8, 64) and (b.page_size, b.rows) == (16, 64)
    assert a.num_pages == b.num_pages == arena.allocator.num_pages == 10
    # sized in bytes: a page costs every device its rows
    assert KVArena.for_models([fat, thin], mesh, 8, memory_bytes_per_device=arena.bytes_per_device).num_pages == 10
    # a model whose rows do not tile the page is refused, as is another KV dtype
    odd = small(num_layers=5, num_kv_heads=4, head_dim=24)
    with pytest.raises(ValueError, match="does not hold whole rows"):
        arena.spec_for(odd)
    with pytest.raises(ValueError, match="must share one kv_dtype"):
        KVArena.for_models([fat, dataclasses.replace(thin, kv_dtype="bfloat16")], mesh, 8, num_pages=4)
    # for_models rounds the page up to whole rows of every model (66 of tiny-dense's, 88 of the odd one's)
    mixed = KVArena.for_models([fat, odd], mesh, 8, num_pages=2)
    assert mixed.words == 2112 and mixed.spec_for(fat).page_size == mixed.spec_for(odd).page_size == 8
    with pytest.raises(ValueError, match="unset with a shared arena"):
        Engine(init_model(fat, mesh, seed=0), dataclasses.replace(CONFIG, num_pages=4), arena=arena)


def test_models_on_one_arena_keep_each_others_kv(pair):
    # A's cached pages hold different heads on each device; B (replicated heads) must neither read nor
    # write them while it serves, so A's next request hits its cache and still decodes exactly
    a, b = pair
    arena = KVArena.for_models([a.cfg, b.cfg], a.mesh, 8, num_pages=64)
    ea, eb = Engine(a, CONFIG, arena=arena), Engine(b, CONFIG, arena=arena)
    assert ea.allocator is eb.allocator and ea.runner.kv is eb.runner.kv
    pa, pb = prompt(0, 40), prompt(1, 30)
    before = buffer_pointers(arena.array)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Some donated buffers were not usable")
        first = ea.generate([pa], GREEDY, progress=False)[0]
        cached = ea.prefix_cache.num_pages
        assert cached == 5
        out_b = eb.generate([pb], GREEDY, progress=False)[0]
        again = ea.generate([pa + first.token_ids], GREEDY, progress=False)[0]
    assert buffer_pointers(arena.array) == before
    assert out_b.token_ids == greedy_generate(b, [pb], GREEDY.max_tokens)[0]
    assert again.cached_tokens == 40 and ea.prefix_cache.num_pages >= cached
    assert again.token_ids == greedy_generate(a, [pa + first.token_ids], GREEDY.max_tokens)[0]


def test_one_models_shortage_evicts_anothers_cached_pages(pair):
    a, b = pair
    arena = KVArena.for_models([a.cfg, b.cfg], a.mesh, 8, num_pages=12)
    ea, eb = Engine(a, CONFIG, arena=arena), Engine(b, CONFIG, arena=arena)
    pa = prompt(2, 60)
    ea.generate([pa], GREEDY, progress=False)
    assert ea.prefix_cache.num_pages == 8 and arena.allocator.num_free == 4
    pb = prompt(3, 80)  # 86 tokens: 11 pages, so B takes A's cached pages
    out = eb.generate([pb], GREEDY, progress=False)[0]
    assert out.token_ids == greedy_generate(b, [pb], GREEDY.max_tokens)[0]
    assert ea.prefix_cache.num_pages < 8 and ea.prefix_cache.stats.evicted_pages > 0
    # A recomputes what was evicted: the same tokens
    again = ea.generate([pa], GREEDY, progress=False)[0]
    assert again.token_ids == greedy_generate(a, [pa], GREEDY.max_tokens)[0]


def test_a_failed_step_tells_every_engine_on_the_arena(pair):
    a, b = pair
    arena = KVArena.for_models([a.cfg, b.cfg], a.mesh, 8, num_pages=32)
    ea, eb = Engine(a, CONFIG, arena=arena), Engine(b, CONFIG, arena=arena)
    pa, pb = prompt(4, 20), prompt(5, 20)
    ea.generate([pa], GREEDY, progress=False)
    assert ea.prefix_cache.num_pages == 3  # 25 computed tokens
    eb.add_request(pb, GREEDY, "b")
    def broken(plan):
        raise RuntimeError("injected device failure")

    eb.before_step = broken
    with pytest.raises(StepError, match="injected device failure"):
        eb.step()
    eb.before_step = None
    # the arena was replaced: A's cached KV went with it, and no page is held for it any more
    assert ea.prefix_cache.num_pages == 0 and arena.allocator.num_free == arena.num_pages
    outs = []
    while eb.has_unfinished():
        outs += [o for o in eb.step() if o.finished]
    assert outs[0].token_ids == greedy_generate(b, [pb], GREEDY.max_tokens)[0]
    assert ea.generate([pa], GREEDY, progress=False)[0].token_ids == greedy_generate(a, [pa], GREEDY.max_tokens)[0]


def _copies_of_at_least(hlo: str, numel: int, op: str = "copy") -> list[str]:
    """The `op` instructions (copies; converts) of a compiled program, fused ones included, whose result
    has at least `numel` elements."""
    out = []
    for line in hlo.splitlines():
        m = re.search(rf"= \w+\[([\d,]*)\]\S* {op}\(", line)
        if m and math.prod(int(d) for d in m.group(1).split(",") if d) >= numel:
            out.append(line.strip())
    return out


@pytest.mark.parametrize("tokens,kv_dtype", [(1, "float32"), (2, "float32"), (5, "float32"), (2, "bfloat16")])
def test_writes_update_the_arena_in_place(tokens, kv_dtype):
    # XLA rewrites a one-index scatter into a select over its whole operand: a copy of the arena every
    # step; and XLA:CPU widens a bf16 scatter or gather to the whole operand in f32 and back. The
    # compiled step-like program and the host tier's restore must hold no arena-sized copy.
    mesh = make_mesh(jax.devices()[:1])
    cfg = dataclasses.replace(load_model_config("tiny-dense"), kv_dtype=kv_dtype)
    arena = KVArena.for_models([cfg], mesh, 8, num_pages=256)
    spec = arena.spec_for(cfg)
    numel = arena.num_pages * arena.words

    def step(a, k, slots, pages):
        for layer in range(spec.num_layers):
            a = write_kv(a, spec, mesh, layer, k, k, slots)
            kb, vb = read_kv(a, spec, mesh, layer, pages)
            k = k + (kb.sum() + vb.sum()) * 1e-9  # the next layer depends on this one, as in a model
        return a, k

    k = np.ones((tokens, spec.kv_heads, spec.head_dim), np.float32)
    args = (arena.array, k, np.arange(tokens, dtype=np.int32), np.zeros((1, 4), np.int32))
    with jax.set_mesh(mesh):
        hlo = jax.jit(step, donate_argnums=0).lower(*args).compile().as_text()
    assert _copies_of_at_least(hlo, numel) == [] and _copies_of_at_least(hlo, numel, "convert") == []
    tier = HostTier(spec, mesh)
    data = np.zeros((spec.num_layers, 2, 1, spec.page_size, spec.kv_heads, spec.head_dim), np.float32)
    with jax.set_mesh(mesh):
        hlo = tier.scatter.lower(arena.array, data, np.zeros(1, np.int32)).compile().as_text()
    assert _copies_of_at_least(hlo, numel) == []


def _resident_bytes(array: jax.Array) -> int:
    """The bytes of `array`'s shards in memory pages the system has backed or mapped (`mincore`)."""
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    array.block_until_ready()  # a buffer's address is known before the program that makes it has run
    total = 0
    for shard in array.addressable_shards:
        start = shard.data.unsafe_buffer_pointer()
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        hi = -(-(start + shard.data.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        vec = ctypes.create_string_buffer((hi - lo) // mmap.PAGESIZE)
        assert mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
        total += sum(b & 1 for b in vec.raw) * mmap.PAGESIZE
    return total


def _huge_pages_always() -> bool:
    try:
        return "[always]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


LINUX_PAGES = pytest.mark.skipif(not sys.platform.startswith("linux") or _huge_pages_always(),
                                 reason="madvise / mincore semantics are Linux's; huge pages back 2 MB at a time")


def _require_unbacked_zeros() -> None:
    """Fails (under `make test`) or skips unless the arena's compiled unbacked zeros are registered."""
    if (error := pool.unbacked_zeros_error()) is not None:
        message = f"the arena's unbacked zeros (kvcache/_arena_native.cpp) are not built: {error}"
        if REQUIRE_NATIVE:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(params=["unbacked", "xla"])
def zeros(request, monkeypatch):
    """Each way a CPU arena's zeros are made: the compiled custom call, or XLA's zeros released after."""
    if request.param == "xla":
        monkeypatch.setattr(pool, "unbacked_zeros_error", lambda: "off in this test")
    else:
        _require_unbacked_zeros()
    return request.param


def _peak_rss_growth(fn) -> int:
    """Bytes the process's peak resident memory rose above its resident memory while `fn()` ran (Linux's
    VmHWM, reset first)."""
    def status(field):
        return int(re.search(rf"^{field}:\s+(\d+) kB", open("/proc/self/status").read(), re.M).group(1)) * 1024
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak := the current resident size
    except OSError as e:
        pytest.skip(f"the peak resident size cannot be reset here ({e.strerror})")
    if status("VmHWM") - status("VmRSS") > 2 ** 24:
        pytest.skip("writing /proc/self/clear_refs did not reset the peak resident size here")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


@LINUX_PAGES
def test_a_cpu_arena_takes_no_memory_until_steps_write(pair, zeros):
    # A 256 MB arena: with the custom call no page is backed even while it is made; with XLA's zeros the
    # whole arena is resident for a moment (the peak) and then handed back.
    a, _ = pair
    words = 2 ** 22 // a.mesh.devices.size  # 16 pages of 16 MB: 256 MB
    arena = []
    growth = _peak_rss_growth(
        lambda: arena.append(pool.allocate_arena(a.mesh, 16, words, "float32").block_until_ready()))
    assert _resident_bytes(arena[0]) <= 2 * mmap.PAGESIZE * a.mesh.devices.size
    assert (growth < 2 ** 26) == (zeros == "unbacked"), growth


@LINUX_PAGES
def test_only_private_anonymous_pages_are_handed_back():
    # MADV_DONTNEED makes a page read as zeros only in private anonymous memory; in a shared or
    # file-backed mapping it reads the old contents again, so the custom call writes zeros there.
    _require_unbacked_zeros()
    import talaria_jax.kvcache._arena_native as native
    page = mmap.PAGESIZE

    def span(m: mmap.mmap, first: int = 0, pages: int = 4) -> tuple[int, int]:
        lo = ctypes.addressof(ctypes.c_char.from_buffer(m)) + first * page
        return lo, lo + pages * page

    private = mmap.mmap(-1, 4 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    shared = mmap.mmap(-1, 4 * page, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    with open(__file__, "rb") as f:
        filed = mmap.mmap(f.fileno(), page, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    assert native.private_anonymous(*span(private))
    assert native.private_anonymous(*span(private, 1, 2))
    mprotect = ctypes.CDLL(None, use_errno=True).mprotect
    mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert mprotect(span(private, 1, 1)[0], page, mmap.PROT_READ) == 0  # three mappings where there was one
    assert native.private_anonymous(*span(private))
    assert not native.private_anonymous(*span(shared))
    assert not native.private_anonymous(*span(filed, pages=1))
    lo, hi = span(private)
    assert not native.private_anonymous(lo, hi + 16 * 2 ** 30)  # past the mapping, into whatever follows
    for m in (private, shared, filed):
        m.close()


def test_sub_byte_dtypes_take_xlas_zeros():
    # The custom call sizes its buffer as elements x bytes each, which a packed sub-byte dtype is not.
    assert [pool._whole_bytes(d) for d in ("float32", "bfloat16", "float8_e4m3fn", "bool", "uint16")] == [True] * 5
    assert not any(pool._whole_bytes(d) for d in ("int4", "uint4", "float4_e2m1fn"))


@LINUX_PAGES
def test_an_arena_on_reused_memory_reads_zeros(pair, zeros):
    # Memory freed by an array that held other values, handed to a new arena (the allocator reuses it),
    # reads as zeros, including the partial memory pages at each end of a device's rows.
    a, _ = pair
    fill = jax.jit(lambda x: x + 7.0, donate_argnums=0)
    dirty, reused = set(), 0
    for words in (1000, 4097, 300_001):
        for _ in range(4):
            arena = pool.allocate_arena(a.mesh, 3, words, "float32")
            reused += len(dirty & set(buffer_pointers(arena)))
            assert not np.asarray(arena).any(), words
            filled = fill(arena)  # in place (donated): the arena's memory holds 7s, freed below
            assert np.asarray(filled).all()
            dirty |= set(buffer_pointers(filled))
            del filled
    if not reused:
        pytest.skip("the allocator handed no freed buffer to a new arena: nothing to check")


@LINUX_PAGES
def test_a_cpu_arena_is_backed_only_where_steps_write(pair, zeros):
    # The process holds the pages the steps write, not the whole pool (without the custom call or the
    # release, all 256 pages are resident from the start). (mincore also counts pages only read, mapped
    # to the zero page: the bound leaves room for a few.)
    a, _ = pair
    arena = KVArena.for_models([a.cfg], a.mesh, 8, num_pages=256)
    page = arena.page_bytes_per_device * arena.mesh.devices.size
    assert _resident_bytes(arena.array) <= 2 * mmap.PAGESIZE * a.mesh.devices.size
    engine = Engine(a, CONFIG, arena=arena)
    p = prompt(6, 20)
    assert engine.generate([p], GREEDY, progress=False)[0].token_ids == greedy_generate(a, [p], GREEDY.max_tokens)[0]
    used = -(-(20 + GREEDY.max_tokens) // 8)  # the sequence's pages (each may straddle one more memory page)
    assert 0 < _resident_bytes(arena.array) <= (2 * used + 2) * page < arena.num_pages * page // 8
    # a released arena reads as zeros
    fresh = KVArena.for_models([a.cfg], a.mesh, 8, num_pages=64)
    assert _resident_bytes(fresh.array) <= 2 * mmap.PAGESIZE * a.mesh.devices.size
    assert not np.asarray(fresh.array).any()
