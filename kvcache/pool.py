"""The paged KV pool: one donated device buffer of uniform pages, shared by every model that uses it.

A `KVArena` is one array per device, [pages, page_words] of one dtype, allocated once by a jitted
zeros with pinned shardings and never reallocated: every step takes it donated and returns it at
the same addresses. On Linux CPU devices the zeros are not written: a custom call (`_arena_native.cpp`)
hands the arena's whole memory pages back to the system (writing only the partial pages at each
end of a device's rows), so a page reads as zeros until a step writes it, and the process's
resident memory grows with the KV held (running sequences and the prefix cache), up to the pool's
size, not with the pool's size from the start (as a CPU engine's uninitialized KV tensors do in
vLLM), nor for a moment while the zeros are made. Where that extension is not built or does not
load (no C++ compiler at install; a jaxlib whose FFI rejects it: a warning says why), and for packed
sub-byte dtypes (int4, float4), XLA writes the zeros and the pages go back as soon as it has
(`_release_zero_pages`): the same afterwards, with the whole pool resident for that moment. Page p of the arena is page p of every model on it, so models of different
shapes share one page budget and one `PageAllocator` (the instance substrate's "one pool of uniform
byte pages"). As in vLLM's hybrid KV cache manager, the pages are uniform in bytes, not in tokens:
each model's `PoolSpec` says how many tokens its pages hold.

A model sees each device's rows as its view [pages, rows, kv_heads, head_dim] (a reshape, so no byte
moves), holding that device's kv heads (all of them where kv_heads does not divide by tp:
replicated, as the model's projections are). A row is one token's K or V of one layer: rows
[2l x page_size, (2l + 1) x page_size) hold layer l's K, the next page_size rows its V; rows past
2 x num_layers x page_size are the page's unused tail (a model with few KV bytes per token leaves a
few rows of each page unused rather than taking more tokens than fit). `KVArena.for_models` sizes
the page so the model with the most KV bytes per token gets `page_size` tokens per page (a few more
where the page is rounded up to whole rows of every model); the others get as many as fit. Only four functions touch the arena, each per device in a shard_map: `write_kv`
and `read_kv` (one layer, in the step), `read_pages` and `write_pages` (whole pages, host tier);
besides them, the Pallas attention kernel (talaria_jax/engine/kernels/) reads one layer's K/V pages
in place, through `on_each_device` and `local_view` as `read_kv` does.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import math
import mmap
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from talaria_jax.kvcache.allocator import PageAllocator
from talaria_jax.models.config import ModelConfig
from talaria_jax.sharding import mesh_platform, spec_for

KV_AXES = ("pages", "page_slots", "kv_heads", "head_dim")  # a device's view of its rows: [pages, rows, kv heads, dim]
# Config precision names that are not jnp dtype names.
_JNP_DTYPES = {"fp8": "float8_e4m3fn"}


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One model's view of a pool: `num_pages` pages of `page_size` tokens. A page is `rows` rows of one
    token's K or V of one layer (0 means exactly the 2 x num_layers x page_size it uses)."""
    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    rows: int = 0

    def __post_init__(self):
        used = 2 * self.num_layers * self.page_size
        if self.rows == 0:
            object.__setattr__(self, "rows", used)
        if self.rows < used:
            raise ValueError(f"PoolSpec.rows ({self.rows}) must be >= 2 x num_layers x page_size ({used})")

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's KV across all layers, K and V (the tokens' bytes, whole kv heads)."""
        return 2 * self.num_layers * self.page_size * self.kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def shape(self) -> tuple[int, ...]:
        """The view's global shape [pages, rows, kv_heads, head_dim]."""
        return self.num_pages, self.rows, self.kv_heads, self.head_dim


def view_sharding(spec: PoolSpec, mesh: Mesh) -> NamedSharding:
    """The view's sharding: kv heads over tp where it divides them, else replicated."""
    return NamedSharding(mesh, spec_for(KV_AXES, spec.shape, mesh))


def kv_shards(spec: PoolSpec, mesh: Mesh) -> int:
    """Ways the kv heads are split on `mesh`: each device holds 1/kv_shards of every page."""
    return spec.kv_heads // view_sharding(spec, mesh).shard_shape(spec.shape)[2]


def page_words(spec: PoolSpec, mesh: Mesh) -> int:
    """Elements of one page on each device (its share of the kv heads, every row)."""
    return spec.rows * (spec.kv_heads // kv_shards(spec, mesh)) * spec.head_dim


def arena_sharding(mesh: Mesh) -> NamedSharding:
    """The arena's [devices, pages, page_words]: one row block per device, in mesh order."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names), None, None))


_UNBACKED_ZEROS = "talaria_unbacked_zeros"  # the custom call's target name


@functools.cache
def unbacked_zeros_error() -> str | None:
    """None where the compiled unbacked zeros are registered with XLA:CPU (once a process), else why not
    (logged once as a warning)."""
    try:
        import talaria_jax.kvcache._arena_native as native
        jax.ffi.register_ffi_target(_UNBACKED_ZEROS, native.zeros_handler(), platform="cpu")
    except Exception as e:  # noqa: BLE001 - an install without a compiler, or a stale build: XLA's zeros serve
        logging.warning("the KV arena's zeros are written by XLA, so the whole pool is resident for a moment "
                        "at each allocation (kvcache/_arena_native.cpp unavailable: %s: %s)", type(e).__name__, e)
        return f"{type(e).__name__}: {e}"
    return None


def _whole_bytes(dtype) -> bool:
    """Whether each element of `dtype` fills its bytes (not a packed sub-byte type: the custom call
    takes the buffer as its element count times the bytes an element takes)."""
    d = jnp.dtype(dtype)
    info = jnp.iinfo(d) if jnp.issubdtype(d, jnp.integer) else jnp.finfo(d) if jnp.issubdtype(d, jnp.floating) else None
    return info is None or info.bits == 8 * d.itemsize


@functools.lru_cache(maxsize=16)
def _zeros_program(mesh: Mesh, num_pages: int, words: int, dtype: str, unbacked: bool):
    """The jitted program that makes an arena (the last few kept: `KVArena.reset` makes the same again)."""
    sharding = arena_sharding(mesh)
    if unbacked:
        rows = jax.ShapeDtypeStruct((1, num_pages, words), jnp.dtype(dtype))
        return jax.jit(on_each_device(jax.ffi.ffi_call(_UNBACKED_ZEROS, rows), mesh, (), sharding.spec),
                       out_shardings=sharding)
    return jax.jit(lambda: jnp.zeros((mesh.devices.size, num_pages, words), jnp.dtype(dtype)), out_shardings=sharding)


def allocate_arena(mesh: Mesh, num_pages: int, words: int, dtype: str):
    """Zeros [devices, num_pages, words], each device's rows created directly on it; on Linux CPU
    devices without backing their memory pages (see the module docstring)."""
    cpu = mesh_platform(mesh) == "cpu"
    unbacked = (cpu and sys.platform.startswith("linux") and _whole_bytes(dtype)
                and unbacked_zeros_error() is None)
    array = _zeros_program(mesh, num_pages, words, dtype, unbacked)()
    if cpu and not unbacked:
        _release_zero_pages(array)
    return array


def _release_zero_pages(array: jax.Array) -> None:
    """Hands the whole memory pages inside each CPU shard of `array`, which must hold only zeros, back
    to the system (`madvise(MADV_DONTNEED)` on XLA's private anonymous memory, which then reads as
    zeros; Linux only, nothing elsewhere): a page is backed again only when written. A shard whose
    call fails keeps its pages (logged)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    array.block_until_ready()
    for shard in array.addressable_shards:
        start = shard.data.unsafe_buffer_pointer()
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (start + shard.data.on_device_size_in_bytes()) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo and madvise(lo, hi - lo, mmap.MADV_DONTNEED) != 0:
            logging.debug("madvise of the KV arena's zeros failed: %s", os.strerror(ctypes.get_errno()))


def allocate_pool(spec: PoolSpec, mesh: Mesh):
    """An arena of exactly `spec`'s pages (one model's own pool)."""
    return allocate_arena(mesh, spec.num_pages, page_words(spec, mesh), spec.dtype)


def on_each_device(fn, mesh: Mesh, in_specs, out_specs):
    """`fn` run on each device's own rows (a shard_map over the arena). Only manual code touches the
    arena: XLA partitions a global view as it likes, and where kv heads are replicated it may then read
    one device's rows for another's, while the arena's rows differ per device (pages hold other
    models' sharded KV). check_vma is off: a replicated model's KV is the same on every device
    because every device computes and writes the same values."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _heads(spec: PoolSpec, mesh: Mesh, lead: int) -> P:
    """The PartitionSpec of an array [*lead dims, ..., kv_heads, head_dim] of `spec`'s KV (heads as the view)."""
    view = tuple(view_sharding(spec, mesh).spec) + (None,) * 4
    return P(*(None,) * lead, view[2], view[3])


def local_view(rows: jax.Array, spec: PoolSpec) -> jax.Array:
    """A device's rows [1, pages, words] as its [pages, rows, local kv heads, head_dim]."""
    return rows.reshape(spec.num_pages, spec.rows, -1, spec.head_dim)


def _as_bits(a: jax.Array) -> jax.Array:
    """A 16-bit float array as the same bits in uint16 (others as they are): scattered and gathered so,
    XLA:CPU moves only the rows a step writes or reads, where over bf16 it widens the whole arena to
    f32 and back in every layer (benchmarks/step_audit.py)."""
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if jnp.dtype(a.dtype).itemsize == 2 else a


def _from_bits(a: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype != dtype else a


def _layer_rows(spec: PoolSpec, layer: int, pages: jax.Array) -> jax.Array:
    """Flat row indices [*pages.shape, page_size] of layer `layer`'s K in `pages` (V: + page_size)."""
    return (pages * spec.rows + 2 * layer * spec.page_size)[..., None] + jnp.arange(spec.page_size)


def write_kv(arena: jax.Array, spec: PoolSpec, mesh: Mesh, layer: int, k: jax.Array, v: jax.Array,
             slots: jax.Array) -> jax.Array:
    """Scatters layer `layer`'s new K/V [T, kv_heads, head_dim] into flat slots (page x page_size +
    offset); slots >= num_slots (padding) are dropped, never clamped. Returns the arena (in place)."""

    def local(rows, k, v, slots):
        ps = spec.page_size
        flat = local_view(rows, spec).reshape(spec.num_pages * spec.rows, -1, spec.head_dim)
        row = slots // ps * spec.rows + 2 * layer * ps + slots % ps  # padding: page == num_pages, out of bounds
        # one scatter of K and V together: at least two indices, since XLA turns a one-index scatter
        # into a select over the whole arena (a copy of it every step)
        new = _as_bits(jnp.concatenate([k, v]).astype(rows.dtype))
        flat = _as_bits(flat).at[jnp.concatenate([row, row + ps])].set(new, mode="drop")
        return _from_bits(flat, rows.dtype).reshape(rows.shape)

    arena_spec = arena_sharding(mesh).spec
    return on_each_device(local, mesh, (arena_spec, _heads(spec, mesh, 1), _heads(spec, mesh, 1), P()),
                   arena_spec)(arena, k, v, slots)


def read_kv(arena: jax.Array, spec: PoolSpec, mesh: Mesh, layer: int, pages: jax.Array):
    """Layer `layer`'s K and V of `pages` (any shape S): two [*S, page_size, kv_heads, head_dim]."""

    def local(rows, pages):
        flat = _as_bits(local_view(rows, spec).reshape(spec.num_pages * spec.rows, -1, spec.head_dim))
        k = _layer_rows(spec, layer, pages)
        return _from_bits(flat[k], rows.dtype), _from_bits(flat[k + spec.page_size], rows.dtype)

    out = _heads(spec, mesh, pages.ndim + 1)
    return on_each_device(local, mesh, (arena_sharding(mesh).spec, P()), (out, out))(arena, pages)


def read_pages(arena: jax.Array, spec: PoolSpec, mesh: Mesh, idx: jax.Array) -> jax.Array:
    """Whole pages `idx` [n] as [n, 2 x layers, page_size, kv_heads, head_dim]; out-of-bounds indices
    read zeros."""

    def local(rows, idx):
        used = local_view(rows, spec).at[idx, :2 * spec.num_layers * spec.page_size].get(mode="fill", fill_value=0)
        return used.reshape(len(idx), 2 * spec.num_layers, spec.page_size, *used.shape[2:])

    return on_each_device(local, mesh, (arena_sharding(mesh).spec, P()), _heads(spec, mesh, 3))(arena, idx)


def write_pages(arena: jax.Array, spec: PoolSpec, mesh: Mesh, idx: jax.Array, pages: jax.Array) -> jax.Array:
    """Writes `pages` ([n, 2 x layers, page_size, kv_heads, head_dim]) into pages `idx` [n];
    out-of-bounds indices are dropped. Returns the arena (in place)."""

    def local(rows, idx, pages):
        pages = pages.reshape(len(idx), -1, *pages.shape[3:]).astype(rows.dtype)
        if len(idx) == 1:  # a second, dropped index: XLA copies the arena for a one-index scatter (write_kv)
            idx, pages = jnp.concatenate([idx, jnp.full_like(idx, spec.num_pages)]), jnp.concatenate([pages, pages])
        view = local_view(rows, spec).at[idx, :2 * spec.num_layers * spec.page_size].set(pages, mode="drop")
        return view.reshape(rows.shape)

    arena_spec = arena_sharding(mesh).spec
    return on_each_device(local, mesh, (arena_spec, P(), _heads(spec, mesh, 3)), arena_spec)(arena, idx, pages)


def kv_dtype(cfg: ModelConfig) -> str:
    return _JNP_DTYPES.get(cfg.kv_dtype, cfg.kv_dtype)


def _row_words(cfg: ModelConfig, mesh: Mesh) -> int:
    """Elements of one row (one token's K or V of one layer) on each device."""
    spec = _model_spec(cfg, 1)
    return page_words(spec, mesh) // spec.rows


def _model_spec(cfg: ModelConfig, page_size: int, num_pages: int = 1, rows: int = 0) -> PoolSpec:
    return PoolSpec(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype(cfg), rows)


def pool_spec(cfg: ModelConfig, page_size: int, mesh: Mesh, *, num_pages: int | None = None,
              memory_bytes_per_device: int | None = None) -> PoolSpec:
    """One model's own pool on `mesh` with exactly one of `num_pages` or as many pages as fit in
    `memory_bytes_per_device` (KV bytes each device may hold: a page costs a device its share of the
    kv heads, the whole page where kv heads are replicated). K/V are stored in cfg.kv_dtype."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    spec = _model_spec(cfg, page_size)
    return dataclasses.replace(spec, num_pages=_num_pages(num_pages, memory_bytes_per_device,
                                                          page_words(spec, mesh) * jnp.dtype(spec.dtype).itemsize))


def _num_pages(num_pages: int | None, memory_bytes_per_device: int | None, page_bytes_per_device: int) -> int:
    if (num_pages is None) == (memory_bytes_per_device is None):
        raise ValueError("give exactly one of num_pages or memory_bytes_per_device")
    if num_pages is None:
        num_pages = memory_bytes_per_device // page_bytes_per_device
        if num_pages < 1:
            raise ValueError(f"KV budget of {memory_bytes_per_device} bytes per device holds no page "
                             f"({page_bytes_per_device} bytes per device each)")
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got {num_pages}")
    return int(num_pages)


class KVArena:
    """The shared pool: `array` ([devices, num_pages, words] of `dtype`, donated through every step and
    copy of every model on it), one `PageAllocator` for all of them, and the prefix caches attached to
    it (`attach`), so that one model's shortage can evict another's cached pages. `generation` counts
    the buffers lost (`reset`): an engine that sees it change recomputes what it was running. Make
    one with `for_models`, or `Engine` makes its own."""

    def __init__(self, mesh: Mesh, num_pages: int, words: int, dtype: str):
        if words < 1:
            raise ValueError(f"page words must be >= 1, got {words}")
        self.mesh, self.num_pages, self.words, self.dtype = mesh, int(num_pages), int(words), str(jnp.dtype(dtype))
        self.allocator = PageAllocator(self.num_pages)
        self.array = allocate_arena(mesh, self.num_pages, self.words, self.dtype)
        self.prefix_caches: list = []  # the models' prefix caches (they share the allocator)
        self.generation = 0  # buffers lost so far

    @property
    def page_bytes_per_device(self) -> int:
        return self.words * jnp.dtype(self.dtype).itemsize

    @property
    def bytes_per_device(self) -> int:
        return self.num_pages * self.page_bytes_per_device

    @classmethod
    def for_models(cls, cfgs: Sequence[ModelConfig], mesh: Mesh, page_size: int, *, num_pages: int | None = None,
                   memory_bytes_per_device: int | None = None) -> "KVArena":
        """An arena whose pages give the model with the most KV bytes per token (per device) `page_size`
        tokens, rounded up so every model's rows tile the page; sized by exactly one of `num_pages` or
        `memory_bytes_per_device`. The models must share one KV dtype."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if not cfgs:
            raise ValueError("KVArena.for_models: give at least one model config")
        dtypes = {c.name: kv_dtype(c) for c in cfgs}
        if len(set(dtypes.values())) > 1:
            raise ValueError(f"models sharing a KV arena must share one kv_dtype, got {dtypes}")
        rows = [_row_words(c, mesh) for c in cfgs]
        words = page_size * max(2 * c.num_layers * r for c, r in zip(cfgs, rows))
        unit = math.lcm(*rows)
        words = -(-words // unit) * unit
        dtype = next(iter(dtypes.values()))
        return cls(mesh, _num_pages(num_pages, memory_bytes_per_device, words * jnp.dtype(dtype).itemsize), words, dtype)

    def spec_for(self, cfg: ModelConfig) -> PoolSpec:
        """`cfg`'s view of this arena: the most tokens per page whose K and V rows of every layer fit a page."""
        if kv_dtype(cfg) != self.dtype:
            raise ValueError(f"{cfg.name}: kv_dtype {kv_dtype(cfg)} differs from the arena's {self.dtype}")
        row = _row_words(cfg, self.mesh)
        page_size = self.words // (row * 2 * cfg.num_layers)
        if self.words % row or page_size < 1:
            raise ValueError(f"{cfg.name}: a page of {self.words} elements per device does not hold whole rows of "
                             f"{row} elements for 2 x {cfg.num_layers} layers")
        if self.num_pages * (self.words // row) >= 2**31:  # flat row indices are int32
            raise ValueError(f"{cfg.name}: {self.num_pages} pages of {self.words // row} rows overflow int32 row "
                             f"indices; use fewer, larger pages")
        return _model_spec(cfg, page_size, self.num_pages, self.words // row)

    def attach(self, prefix_cache) -> None:
        """Adds a model's prefix cache (a `kvcache.prefix.PrefixCache` over this arena's allocator)."""
        self.prefix_caches.append(prefix_cache)

    def reset(self) -> None:
        """A fresh zeroed buffer (after a failed step may have consumed the donated one): the prefix
        caches, whose KV went with the old one, are emptied and `generation` moves on."""
        self.array = allocate_arena(self.mesh, self.num_pages, self.words, self.dtype)
        for cache in self.prefix_caches:
            cache.clear()
        self.generation += 1


def buffer_pointers(pool) -> list[int]:
    """Per-shard device addresses of every array in `pool` (stable across donated steps)."""
    return [s.data.unsafe_buffer_pointer() for a in jax.tree.leaves(pool) for s in a.addressable_shards]
