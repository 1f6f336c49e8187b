"""The Pallas ragged paged-attention kernel (interpreted on CPU) against the plain-jnp reference, over a
real KV arena: page sizes, query tiles, partial pages, sliding windows, GQA ratios, replicated kv
heads on multi-device meshes, draft trees, bf16 K/V, padding tokens; and the engine's dispatch."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from talaria_jax.engine import kernels
from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.kernels import check_shapes, ragged_paged_attention as kernel_attention
from talaria_jax.engine.paged_attention import AttentionMetadata, ragged_paged_attention as reference_attention
from talaria_jax.engine.runner import NO_TREE, attention_kind, query_tiles, seq_runs
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.kvcache.pool import PoolSpec, allocate_pool, read_kv, write_kv
from talaria_jax.models import init_model, load_model_config
from talaria_jax.models.model import with_params
from talaria_jax.engine.spec.suffix import Draft, SpecConfig
from talaria_jax.sharding import make_mesh

# (page-table row, first position, tokens) of each run: a 7-token prefill chunk over partial pages, a
# decode token, a 3-token chunk from position 0, and a decode token deep in a long sequence
RUNS = [(1, 6, 7), (0, 9, 1), (2, 0, 3), (3, 37, 1)]
PADDING = 3


def _batch(ps, ppb, tile, runs=RUNS, padding=PADDING, seed=0):
    """Flat tokens of `runs` then `padding` padding tokens, their tiles, and page tables of random pages."""
    rng = np.random.RandomState(seed)
    seq = np.array([r for r, _, n in runs for _ in range(n)] + [0] * padding, np.int32)
    pos = np.array([p + i for _, p, n in runs for i in range(n)] + [0] * padding, np.int32)
    real = len(seq) - padding
    width = -(-(max(p + n for _, p, n in runs) // ps + 1) // ppb) * ppb
    pages = rng.permutation(len(runs) * width).reshape(len(runs), width).astype(np.int32)
    need = sum(-(-n // tile) for _, _, n in runs)
    tiles = query_tiles(seq_runs(seq, real), len(seq), tile, need + 1)  # one empty tile too
    num_blocks = max(p + n - 1 for _, p, n in runs) // (ps * ppb) + 1
    return seq, pos, pages, tiles, num_blocks


def _arena(mesh, spec, seed=1):
    """An arena whose every slot of every layer holds random K/V."""
    rng = np.random.RandomState(seed)
    arena = allocate_pool(spec, mesh)
    slots = jnp.arange(spec.num_slots, dtype=jnp.int32)
    for layer in range(spec.num_layers):
        k, v = (jnp.asarray(rng.randn(spec.num_slots, spec.kv_heads, spec.head_dim), jnp.float32) for _ in "kv")
        arena = write_kv(arena, spec, mesh, layer, k, v, slots)
    return arena


def _both(mesh, *, kvh=2, g=2, d=16, ps=4, ppb=2, tile=4, window=0, dtype="float32", runs=RUNS, tree=None,
          layer=1, sinks=None):
    """(kernel, reference, number of real tokens) for one batch over a random arena."""
    seq, pos, pages, (tile_tok, tile_seq, tok_slot), num_blocks = _batch(ps, ppb, tile, runs)
    spec = PoolSpec(2, pages.size, ps, kvh, d, dtype)
    arena = _arena(mesh, spec)
    q = jnp.asarray(np.random.RandomState(2).randn(len(seq), kvh * g, d), jnp.float32)
    meta = AttentionMetadata(jnp.asarray(pages), jnp.asarray(pos), jnp.asarray(tile_tok), jnp.asarray(tile_seq),
                             jnp.asarray(tok_slot), jnp.int32(num_blocks), tree)

    @jax.jit
    def run(arena, q):
        read = functools.partial(read_kv, arena, spec, mesh, layer)
        return (kernel_attention(q, arena, spec, mesh, layer, meta, ppb, window, sinks),
                reference_attention(q, read, kvh, ps, meta, ppb, window, sinks))

    with jax.set_mesh(mesh):
        out, ref = run(arena, q)
    return np.asarray(out), np.asarray(ref), len(seq) - PADDING


def _mesh(n):
    return make_mesh(jax.devices()[:n])


@pytest.mark.parametrize("ps,ppb,tile,g,window", [
    (4, 2, 1, 1, 0),    # decode-style tiles of one, no GQA
    (4, 2, 4, 2, 0),    # tiles of 4, partial pages
    (8, 1, 16, 4, 0),   # a prefill tile of 16, GQA 4
    (4, 2, 4, 2, 5),    # sliding window (skips the pages below it)
    (16, 2, 16, 1, 9),  # page of 16, window, tile of 16
])
def test_kernel_matches_reference(ps, ppb, tile, g, window):
    out, ref, real = _both(_mesh(1), ps=ps, ppb=ppb, tile=tile, g=g, window=window)
    np.testing.assert_allclose(out[:real], ref[:real], rtol=1e-5, atol=1e-6)
    assert np.all(out[real:] == 0)  # padding tokens' rows are zero


@pytest.mark.parametrize("devices,kvh,g", [
    (2, 4, 2),  # kv heads split over tp=2 (each device its own 2 kv heads)
    (4, 2, 2),  # kv heads replicated on tp=4: one q head per device
    (2, 3, 4),  # replicated kv heads, 6 q heads per device straddling kv heads (groups of 2)
])
def test_kernel_on_a_multi_device_mesh(devices, kvh, g):
    out, ref, real = _both(_mesh(devices), kvh=kvh, g=g, tile=4)
    np.testing.assert_allclose(out[:real], ref[:real], rtol=1e-5, atol=1e-6)
    assert np.all(out[real:] == 0)


@pytest.mark.parametrize("devices,kvh,g,tile,window", [
    (1, 2, 2, 1, 0),  # decode tiles, GQA 2
    (1, 2, 4, 4, 5),  # prefill tiles beside decode, sliding window
    (2, 3, 4, 4, 0),  # replicated kv heads, a device's q heads straddling two kv heads
])
def test_kernel_with_attention_sinks(devices, kvh, g, tile, window):
    """gpt-oss's sinks: each head's logit joins its rows' softmax with no value, so every output shrinks
    by the sink's share, differently per head."""
    sinks = jnp.asarray(np.random.RandomState(3).randn(kvh * g) * 2, jnp.float32)
    out, ref, real = _both(_mesh(devices), kvh=kvh, g=g, tile=tile, window=window, sinks=sinks)
    np.testing.assert_allclose(out[:real], ref[:real], rtol=1e-5, atol=1e-6)
    assert np.all(out[real:] == 0)
    plain, _, _ = _both(_mesh(devices), kvh=kvh, g=g, tile=tile, window=window)
    assert not np.allclose(plain[:real], out[:real], atol=1e-3)  # the sinks matter


def test_kernel_with_draft_trees():
    # a 4-node draft tree after 10 cached tokens: root (bit 0), two children of the root (bits 1, 2),
    # a grandchild under the first child (bit 3); sibling branches must not see each other
    runs = [(0, 10, 4), (1, 5, 1)]
    anc = jnp.asarray([0b1, 0b11, 0b101, 0b1011, 0, 0, 0, 0], jnp.int32)
    base = jnp.asarray([10] * 4 + [NO_TREE] * 4, jnp.int32)
    out, ref, real = _both(_mesh(1), runs=runs, tree=(base, anc), tile=4, ps=4, ppb=1)
    np.testing.assert_allclose(out[:real], ref[:real], rtol=1e-5, atol=1e-6)
    plain, _, _ = _both(_mesh(1), runs=runs, tile=4, ps=4, ppb=1)
    assert not np.allclose(plain[2], out[2])  # the mask matters: node 2 would otherwise see node 1


def test_bf16_kv_accumulates_in_fp32():
    # bf16 K/V (and q cast to bf16 for the dots) against the fp32 reference over the same bf16 K/V:
    # the differences are bf16 roundings (2^-8 relative) of q and of the probabilities, not of the
    # accumulation: within 1e-2 (about 4e-3 here, on outputs up to ~3)
    out, ref, real = _both(_mesh(1), dtype="bfloat16", tile=16, ps=8, ppb=2)
    np.testing.assert_allclose(out[:real], ref[:real], rtol=1e-2, atol=1e-2)
    assert np.all(out[real:] == 0)



@pytest.mark.parametrize("tile,g,window,tree,dtype", [(1, 8, 128, False, "bfloat16"), (16, 2, 0, True, "float32")])
def test_kernel_lowers_to_triton(tile, g, window, tree, dtype):
    """The GPU path (no interpreter) lowers to one Triton call: exported for CUDA, which needs no GPU,
    so shapes or ops Triton's lowering refuses fail here, not first on a GPU."""
    mesh = _mesh(1)
    spec = PoolSpec(2, 64, 16, 2, 64, dtype)
    t, nt = 32, 32 // tile
    a = jax.ShapeDtypeStruct
    i32 = functools.partial(a, dtype=jnp.int32)

    def f(arena, q, pages, pos, tile_tok, tile_seq, tok_slot, num_blocks, *tree):
        meta = AttentionMetadata(pages, pos, tile_tok, tile_seq, tok_slot, num_blocks, tree or None)
        return kernel_attention(q, arena, spec, mesh, 1, meta, 4, window, interpret=False)

    args = [a((1, 64, spec.rows * 2 * 64), jnp.dtype(dtype)), a((t, 2 * g, 64), jnp.bfloat16), i32((4, 8)), i32((t,)),
            i32((nt, tile)), i32((nt,)), i32((t,)), i32(())] + [i32((t,)), i32((t,))] * tree
    with jax.set_mesh(mesh):
        exported = jax.export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert exported.mlir_module().count("xla.gpu.triton") == 1


def test_gpu_shape_checks_and_attention_choice(monkeypatch):
    with pytest.raises(ValueError, match="page_size to be a power of two >= 16 on GPU, got 8"):
        check_shapes(8, 64)
    with pytest.raises(ValueError, match="head_dim to be a power of two >= 16 on GPU, got 48"):
        check_shapes(16, 48)
    check_shapes(4, 8, gpu=False)  # the interpreter takes any shape
    small, fits = PoolSpec(2, 8, 4, 2, 64), PoolSpec(2, 8, 16, 2, 64)
    mesh = _mesh(1)
    assert [attention_kind(a, mesh, fits) for a in ("auto", "pallas", "reference")] == ["reference", "pallas",
                                                                                         "reference"]  # CPU
    monkeypatch.setattr(kernels, "on_gpu", lambda mesh: True)
    assert attention_kind("auto", mesh, fits) == "pallas"
    assert attention_kind("auto", mesh, small) == "reference"  # pages Triton cannot tile
    with pytest.raises(ValueError, match="EngineConfig.attention='pallas': .*page_size"):
        attention_kind("pallas", mesh, small)


def test_engine_config_attention_is_validated():
    with pytest.raises(ValueError, match="EngineConfig.attention must be one of 'reference', 'pallas', 'auto', "
                                         "got 'triton'"):
        EngineConfig(attention="triton").validate()
    assert EngineConfig().attention == "auto"


# ---- the engine ------------------------------------------------------------------------------------

def _prompts(seed, lengths):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 256, n).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _config(attention):
    return EngineConfig(warmup=False, page_size=4, max_seqs=2, max_tokens_per_step=8, max_model_len=64,
                        pages_per_block=2, query_tile=4, attention=attention)


def _generate(model, attention, prompts):
    eng = Engine(model, _config(attention))
    assert eng.runner.attention == attention
    return [o.token_ids for o in eng.generate(prompts, GREEDY, progress=False)], eng


def test_engine_greedy_is_the_same_with_the_kernel():
    """A sliding-window layer and a full one; prefill chunks in tiles of 4 beside decode tokens; and
    speculation: the kernel's engine verifies drafts of the reference's next two tokens and a wrong
    third (draft masks in the kernel), which changes no greedy token, so its output must be the
    reference engine's while accepting drafts."""
    cfg = load_model_config("tiny-dense").replace(num_layers=2, sliding_windows=(6, 0))
    model = init_model(cfg, make_mesh(jax.devices()[:1]), seed=5)
    prompts = _prompts(6, (5, 13))
    want, _ = _generate(model, "reference", prompts)
    truth = {tuple(p): w for p, w in zip(prompts, want)}
    eng = Engine(model, dataclasses.replace(_config("pallas"), speculation=SpecConfig(policy="always")))

    def oracle(ids, caps):  # a chain: the true next two tokens, then a wrong one
        out = []
        for rid, cap in zip(ids, caps):
            req = eng.requests[rid]
            nxt = truth[req.prompt][len(req.output):][:2]
            toks = [*nxt, (nxt[-1] + 1) % 256] if nxt else []
            out.append(Draft(np.asarray(toks, np.int32), np.arange(len(toks), dtype=np.int32) - 1,
                             np.ones(len(toks), np.float32)).first(cap))
        return out

    eng.drafter.draft = oracle
    got = [o.token_ids for o in eng.generate(prompts, GREEDY, progress=False)]
    assert got == want
    assert eng.runner.attention == "pallas" and 0 < eng.stats.accepted_tokens < eng.stats.draft_tokens


def test_engine_with_attention_sinks_runs_the_kernel():
    """A gpt-oss-style model (sinks, a sliding-window layer and a full one): the kernel's engine gives the
    reference's greedy tokens and logprobs; "auto" would pick the kernel on a GPU (no refusal for sinks)."""
    cfg = load_model_config("tiny-dense").replace(num_layers=2, sliding_windows=(6, 0), attention_sinks=True)
    model = init_model(cfg, make_mesh(jax.devices()[:1]), seed=5)
    rng = np.random.RandomState(7)
    params = {k: rng.randn(*v.shape) * 2 if k.endswith(".sinks") else v  # sinks of either sign, per head
              for k, v in model.param_arrays().items()}
    model = with_params(model, params, "sinks")
    prompts = _prompts(8, (5, 13))
    sampling = dataclasses.replace(GREEDY, logprobs=0)
    ref = Engine(model, _config("reference")).generate(prompts, sampling, progress=False)
    got = Engine(model, _config("pallas")).generate(prompts, sampling, progress=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    np.testing.assert_allclose([o.logprobs for o in got], [o.logprobs for o in ref], rtol=1e-5, atol=1e-5)


def test_steps_pad_to_two_tokens_on_a_gpu(monkeypatch):
    """On GPUs a step has at least two token rows (XLA's GPU compiler turns one-row matmuls into a
    multiply and a reduction through memory): a lone decode runs in the 2-token bucket, with the same
    greedy tokens as the CPU engine's 1-token steps."""
    model = init_model(load_model_config("tiny-dense").replace(num_layers=2), make_mesh(jax.devices()[:1]), seed=5)
    prompts = _prompts(9, (6,))
    want, cpu = _generate(model, "reference", prompts)
    assert cpu.runner.buckets[0] == 1
    monkeypatch.setattr(kernels, "on_gpu", lambda mesh: True)
    got, gpu = _generate(model, "reference", prompts)
    assert gpu.runner.buckets[:2] == (2, 4) and gpu.runner.bucket(1) == 2
    assert got == want
