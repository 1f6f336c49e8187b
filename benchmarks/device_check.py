"""One prepared check of a GPU machine (`benchmarks/device_check.sh` runs it).

On the accelerator it measures, in one run:
  1. what JAX sees (backend, devices, memory kinds) and whether `pinned_host` works, with H2D / D2H
     bandwidth of a device_put between a device sharding and a pinned_host sharding;
  2. HBM copy bandwidth (a jitted read + write of a large buffer);
  3. the paged engine on the accelerator: tiny-dense fp32 greedy output equals the full-sequence
     reference, the KV pool keeps its buffer addresses across steps; once with the jnp reference
     attention and once with the Pallas kernel (keys `pallas_...`);
  4. decode step time of a ~1B-parameter bf16 Llama-shaped model at several batch sizes from a
     synthetic 2K-token KV prefix, against the HBM roofline (weight + KV bytes per step over the
     measured copy bandwidth), and the same decode with the parameters carved out of an instance's
     flat weight slot (talaria_jax/weights/slot.py): on CPU the carve copies every parameter each
     step (~4x slower); whether XLA:GPU reads the slot in place is what the slot/own column shows;
  5. weight-slot switch of that model (`common.switch_times`, as in benchmarks/model_switch.py): the staged
     switch (a device-to-device copy into the slot) against the HBM copy rate (hbm_copy_gb_s / 2:
     that figure counts read + write), and the load and the staging copy (host-to-device) against the
     pinned_host device_put of 1.;
  6. host KV restore on that model's pool (`common.copy_times`, as in benchmarks/host_restore.py), 8K and 32K
     tokens of KV: the host tier's restore (H2D + scatter into pages) and offload (gather + D2H)
     against a bare device_put of the same bytes; where the backend has no host memory kind the
     tier keeps its copies in device memory and there is no device_put to compare with;
  7. prefill of a 256-token chunk over 8K and 32K tokens of cached prefix on that model
     (`common.prefill_tok_s`, as in benchmarks/engine_prefill.py), next to prefilling the whole context
     from scratch in chunks of 2048 tokens (`common.ttft`, as in benchmarks/host_restore.py);
  8. the Pallas ragged paged-attention kernel (talaria_jax/engine/kernels/) against the jnp reference,
     one layer of that model's shapes over bf16 K/V: decode at each batch size over 2K and 8K
     contexts, and a 256-token prefill chunk in tiles of 16 over 2K, with the speed-up and the largest
     difference of their outputs (the kernel's only check on a GPU);
  9. FP8: that model's shapes with every attention and FFN matrix stored as FP8 with 128 x 128 block
     scales (as Qwen3-FP8 ships; dequantized inside the step, talaria_jax/models/quant.py) against
     the same weights dequantized once to bf16: greedy tokens side by side, decode tok/s at each
     batch size over the 2K prefix, and the bytes each holds. There is no FP8 matmul: this times the
     in-step dequantization against reading bf16 weights.
Sections 4-7 share one model, built once; 5-8 take the best of --reps (after an untimed run). A
section that fails is printed and recorded as {"error": ...}, and the run goes on; the JSON is
rewritten after each section (with the seconds each took under "seconds"), so a run cut short keeps
what it measured. Prints tables and writes JSON to --out. `--small` shrinks every size so that the
script runs on a CPU in seconds (tests/project/test_device_check.py keeps it from rotting).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
import traceback

from absl import app, flags

from benchmarks import common

_OUT = flags.DEFINE_string("out", "/tmp/device_check.json", "Write the results as JSON here.")
_SMALL = flags.DEFINE_bool("small", False, "Tiny sizes (a CPU smoke run).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32", "64"], "Decode batch sizes.")
_SECTIONS = flags.DEFINE_list("sections", [], "Run only these sections (memory always runs): engine_parity, "
                               "decode, step_profile, weight_switch, host_restore, prefill_cached, kernel, fp8.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions of each measurement of sections 5-8 (best is reported).")


def bench_config(small: bool):
    from talaria_jax.models import ModelConfig

    if small:
        return ModelConfig(name="small", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=32, ffn_size=256, dtype="float32", weight_dtype="float32", kv_dtype="float32")
    return common.llama_1b_shape()


@functools.cache
def bench_model(small: bool):
    """The model of sections 4-7, built on first use (so a failure is the section's) and then shared."""
    import jax

    from talaria_jax.models import init_model
    from talaria_jax.sharding import make_mesh

    return init_model(bench_config(small), make_mesh(jax.devices()[:1]), seed=0)


def memory_checks(nbytes: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from talaria_jax.sharding import make_mesh

    dev = jax.devices()[0]
    kinds = sorted(m.kind for m in dev.addressable_memories())
    mesh = make_mesh([dev])
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), NamedSharding(mesh, P()))
    out = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()], "memory_kinds": kinds,
           "jax_version": jax.__version__}
    if "pinned_host" in kinds:
        host = NamedSharding(mesh, P(), memory_kind="pinned_host")
        on_host = jax.device_put(x, host)
        out["pinned_host_roundtrip_equal"] = bool(jnp.array_equal(jax.device_put(on_host, x.sharding), x))
        out["d2h_gb_s"] = nbytes / common.best_time(lambda: jax.device_put(x, host), 5) / 1e9
        out["h2d_gb_s"] = nbytes / common.best_time(lambda: jax.device_put(on_host, x.sharding), 5) / 1e9
    copy = jax.jit(lambda a: a * 1.0001)
    out["hbm_copy_gb_s"] = 2 * nbytes / common.best_time(lambda: copy(x), 5) / 1e9  # read + write
    return out


def engine_parity() -> dict:
    import jax
    import numpy as np

    from talaria_jax.engine import Engine, EngineConfig, SamplingParams
    from talaria_jax.kvcache.pool import buffer_pointers
    from talaria_jax.models import greedy_generate, init_model, load_model_config
    from talaria_jax.sharding import make_mesh

    model = init_model(load_model_config("tiny-dense"), make_mesh(jax.devices()[:1]), seed=1)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 256, n).tolist() for n in (3, 17, 40, 9)]
    ref = greedy_generate(model, prompts, 12)
    out = {}
    for attention in ("reference", "pallas"):  # page_size 16: the kernel's smallest on GPU
        eng = Engine(model, EngineConfig(page_size=16, max_seqs=4, max_tokens_per_step=32, max_model_len=128,
                                         warmup=False, attention=attention))
        before = buffer_pointers(eng.runner.kv)
        outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                            progress=False)
        tag = "" if attention == "reference" else "pallas_"  # the Pallas kernel's keys: pallas_...
        out.update({f"{tag}engine_greedy_equals_reference": [o.token_ids for o in outs] == ref,
                    f"{tag}pool_addresses_stable": buffer_pointers(eng.runner.kv) == before,
                    f"{tag}engine_steps": eng.stats.steps, f"{tag}compilations": eng.runner.compilations})
    return out


def decode_roofline(small: bool, batches: list[int], hbm_gb_s: float) -> list[dict]:
    from talaria_jax.engine import Engine, EngineConfig
    from talaria_jax.weights.slot import HostWeights, SlotLayout, WeightSlot

    ctx, steps = (64, 2) if small else (2048, 32)
    model = bench_model(small)
    cfg = model.cfg
    layout = SlotLayout.of(model)
    slot = WeightSlot.for_layouts(model.mesh, [layout])
    slot.load(HostWeights.of(model, layout))
    rows = []
    for batch in batches:
        eng = Engine(model, EngineConfig(page_size=16, max_seqs=batch, max_tokens_per_step=max(batch, 16),
                                         max_model_len=-(-(ctx + steps + 8) // 16) * 16, warmup=False))
        tok_s = common.decode_with_synthetic_prefix(eng, batch, ctx, steps)
        del eng
        eng = Engine(model, EngineConfig(page_size=16, max_seqs=batch, max_tokens_per_step=max(batch, 16),
                                         max_model_len=-(-(ctx + steps + 8) // 16) * 16, warmup=False))
        eng.runner.use_slot(slot, layout)
        slot_tok_s = common.decode_with_synthetic_prefix(eng, batch, ctx, steps)
        step_bytes = cfg.weight_bytes() + batch * (ctx + steps / 2) * cfg.kv_bytes_per_token()
        roof = batch / (step_bytes / (hbm_gb_s * 1e9))
        rows.append({"model": cfg.name, "params": cfg.param_count(), "batch": batch, "context": ctx,
                     "tok_s": tok_s, "step_ms": 1e3 * batch / tok_s, "roofline_tok_s": roof,
                     "of_roofline": tok_s / roof, "slot_tok_s": slot_tok_s, "slot_over_own": slot_tok_s / tok_s})
        del eng
    return rows


def weight_switch(small: bool, reps: int, hbm_gb_s: float, h2d_gb_s: float | None) -> list[dict]:
    """GB/s of switching the model's weights into a WeightSlot, each path against its bandwidth limit."""
    import jax

    from talaria_jax.weights.slot import HostWeights, SlotLayout, WeightSlot

    model = bench_model(small)
    layout = SlotLayout.of(model)
    host = HostWeights.of(model, layout)
    slot = WeightSlot.for_layouts(model.mesh, [layout])
    # switch_times also times an Orbax restore between the switches: here it returns the model itself
    # (already on the device, so it costs nothing and is not reported).
    times = common.switch_times(slot, [host], lambda: model, reps)
    nbytes = layout.bytes_per_device * model.mesh.devices.size
    kind = host.data.sharding.memory_kind if isinstance(host.data, jax.Array) else None  # None: numpy
    rows = []
    for path, key, limit, limit_name in (
            ("activate_staged (D2D into the slot)", "activate_staged", hbm_gb_s / 2, "HBM copy (hbm_copy_gb_s / 2)"),
            ("load (H2D into the slot)", "load", h2d_gb_s, "pinned_host device_put"),
            ("staging copy (H2D, issue to arrival)", "stage_copy", h2d_gb_s, "pinned_host device_put")):
        best = min(times[key])
        gb_s = nbytes / best / 1e9
        rows.append(dict(path=path, gb=nbytes / 1e9, best_ms=best * 1e3, gb_s=gb_s, limit=limit_name,
                         limit_gb_s=limit, of_limit=gb_s / limit if limit else None, host_memory_kind=kind))
    return rows


def host_kv_restore(small: bool, reps: int) -> list[dict]:
    """GB/s of the host tier's restore and offload of a prefix's KV pages, and of a bare device_put of
    the same bytes each way (where the backend has host memory)."""
    from talaria_jax.engine import Engine, EngineConfig
    from talaria_jax.kvcache.host_tier import HostTier

    model = bench_model(small)
    contexts, page = ((64, 128) if small else (8192, 32768)), 16
    eng = Engine(model, EngineConfig(page_size=page, max_seqs=1, max_tokens_per_step=16,
                                     max_model_len=max(contexts) + page, warmup=False))
    kind = eng.host_tier.memory_kind
    if kind is None:  # no host memory kind: let the tier keep its copies in device memory (no H2D to compare)
        eng.host_tier = HostTier(eng.pool_spec, model.mesh, model=model.cfg.name, weights=model.fingerprint,
                                 device_fallback_bytes=1 << 40)
    rows = []
    for ctx in contexts:
        pages = eng.allocator.allocate(ctx // page)
        kv = eng.host_tier.offload(eng.runner.kv, pages, range(ctx))  # what the pages hold does not matter
        eng.allocator.free(pages)
        t = common.copy_times(eng, kv, reps)
        gb = kv.host_bytes / 1e9
        row = dict(context=ctx, memory_kind=kind or "device (fallback)", copy_mb=gb * 1e3,
                   restore_ms=t["restore_s"] * 1e3, restore_gb_s=gb / t["restore_s"], h2d_gb_s=None,
                   restore_of_device_put=None, offload_gb_s=gb / t["offload_s"], d2h_gb_s=None,
                   offload_of_device_put=None)
        if kind:  # device_put from / to the tier's host memory kind: the copy's bandwidth limit
            row.update(h2d_gb_s=gb / t["h2d_s"], restore_of_device_put=t["h2d_s"] / t["restore_s"],
                       d2h_gb_s=gb / t["d2h_s"], offload_of_device_put=t["d2h_s"] / t["offload_s"])
        rows.append(row)
        eng.host_tier.release(kv)
    return rows


def prefill_cached(small: bool, reps: int) -> list[dict]:
    """A chunk prefilled over a cached prefix vs the whole context prefilled from scratch."""
    import numpy as np

    from talaria_jax.engine import Engine, EngineConfig

    model = bench_model(small)
    contexts, chunk, recompute_chunk = ((64, 128), 32, 64) if small else ((8192, 32768), 256, 2048)
    tile = EngineConfig().query_tile
    rows = []
    for ctx in contexts:  # one engine per context (prefill_tok_s builds it); its first step compiles
        tok_s = common.prefill_tok_s(model, ctx, chunk, tile, reps)
        rows.append(dict(context=ctx, chunk=chunk, chunk_ms=1e3 * chunk / tok_s, chunk_tok_s=tok_s))
    page = 16
    eng = Engine(model, EngineConfig(page_size=page, max_seqs=1, max_tokens_per_step=recompute_chunk,
                                     max_model_len=-(-(max(contexts) + chunk + 8) // page) * page, warmup=False))
    rng = np.random.RandomState(1)
    for r in rows:
        prompt = rng.randint(0, model.cfg.vocab_size, r["context"] + chunk).tolist()
        best = min(common.ttft(eng, prompt) for _ in range(reps + 1))  # the first run may compile
        r.update(recompute_chunk=recompute_chunk, recompute_ms=best * 1e3, recompute_tok_s=len(prompt) / best,
                 recompute_over_chunk=best * 1e3 / r["chunk_ms"])
    return rows


def kernel_speedup(small: bool, batches: list[int], reps: int) -> list[dict]:
    """One layer's ragged paged attention, the Pallas kernel (talaria_jax/engine/kernels/) against the
    jnp reference (talaria_jax/engine/paged_attention.py), on the bench model's shapes and KV dtype
    over an arena of random K/V: decode (tiles of one token, each sequence `context` tokens deep) at
    each batch size, and one prefill chunk in tiles of 16 over a cached context. Each time is the best
    of `reps` runs of `calls` calls dispatched back to back; max_abs_diff compares the two outputs (the
    kernel's check on a GPU). On CPU the kernel runs in the Pallas interpreter, so the speed-up there
    means nothing; --small is a smoke run."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from talaria_jax.engine.kernels import on_gpu, ragged_paged_attention as kernel
    from talaria_jax.engine.paged_attention import AttentionMetadata, ragged_paged_attention as reference
    from talaria_jax.engine.runner import query_tiles, reference_blocks, seq_runs
    from talaria_jax.kvcache.pool import PoolSpec, arena_sharding, page_words, read_kv
    from talaria_jax.sharding import make_mesh

    cfg = bench_config(small)
    mesh = make_mesh(jax.devices()[:1])
    contexts, chunk, ps, ppb, calls = ((64, 128), 32, 16, 4, 2) if small else ((2048, 8192), 256, 16, 4, 10)
    num_pages = max(max(batches) * (max(contexts) // ps + 1), (max(contexts) + chunk) // ps + 1)
    spec = PoolSpec(1, num_pages, ps, cfg.num_kv_heads, cfg.head_dim, cfg.kv_dtype)
    arena = jax.jit(lambda key: jax.random.normal(key, (1, num_pages, page_words(spec, mesh)), jnp.dtype(spec.dtype)),
                    out_shardings=arena_sharding(mesh))(jax.random.key(0))
    rng = np.random.RandomState(0)

    def case(kind: str, batch: int, ctx: int, pos: np.ndarray, seq: np.ndarray, tile: int) -> dict:
        t = len(pos)
        width = -(-(int(pos.max()) // ps + 1) // ppb) * ppb
        tables = rng.randint(0, num_pages, (batch, width)).astype(np.int32)  # pages may repeat: timing only
        runs = seq_runs(seq, t)
        tiles = query_tiles(runs, t, tile, sum(-(-(e - a) // tile) for _, a, e in runs))
        q = jnp.asarray(rng.randn(t, cfg.num_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
        meta = AttentionMetadata(jnp.asarray(tables), jnp.asarray(pos), *map(jnp.asarray, tiles),
                                 jnp.int32(int(pos.max()) // (ps * ppb) + 1))

        def ref(arena, q, m):  # with the blocks the engine's runner uses
            blocks, pages_per_block = reference_blocks(tile, m.num_blocks, ppb)
            return reference(q, functools.partial(read_kv, arena, spec, mesh, 0), spec.kv_heads, ps,
                             dataclasses.replace(m, num_blocks=blocks), pages_per_block)
        fns = {"pallas": jax.jit(lambda arena, q, m: kernel(q, arena, spec, mesh, 0, m, ppb)), "reference": jax.jit(ref)}
        with jax.set_mesh(mesh):
            outs = {k: f(arena, q, meta) for k, f in fns.items()}
            ms = {k: 1e3 * common.best_time(lambda f=f: [f(arena, q, meta) for _ in range(calls)][-1], reps) / calls
                  for k, f in fns.items()}
        diff = float(jnp.max(jnp.abs(outs["pallas"].astype(jnp.float32) - outs["reference"].astype(jnp.float32))))
        return dict(kind=kind, batch=batch, context=ctx, tokens=t, tile=tile, pallas_ms=ms["pallas"],
                    reference_ms=ms["reference"], speedup=ms["reference"] / ms["pallas"], max_abs_diff=diff,
                    interpreted=not on_gpu(mesh))

    rows = [case("decode", b, ctx, np.full(b, ctx, np.int32), np.arange(b, dtype=np.int32), 1)
            for ctx in contexts for b in batches]
    ctx = contexts[0]
    rows.append(case("prefill", 1, ctx, np.arange(ctx, ctx + chunk, dtype=np.int32), np.zeros(chunk, np.int32), 16))
    return rows


def fp8_decode(small: bool, batches: list[int]) -> list[dict]:
    """Section 9: FP8 weights (block scales, dequantized in the step) against the same weights dequantized
    once to the model's compute dtype (bf16; fp32 in the --small run)."""
    import jax
    import numpy as np

    from talaria_jax.engine import Engine, EngineConfig, SamplingParams
    from talaria_jax.models import init_model
    from talaria_jax.models.model import dequantized
    from talaria_jax.models.quant import QuantConfig
    from talaria_jax.sharding import make_mesh

    cfg = bench_config(small).replace(quant=QuantConfig("fp8", (128, 128)))
    fp8 = init_model(cfg, make_mesh(jax.devices()[:1]), seed=0)
    models = {"fp8": fp8, "dequantized": dequantized(fp8)}
    held = {k: sum(a.nbytes for a in m.param_arrays().values()) for k, m in models.items()}
    prompts = [np.random.RandomState(i).randint(0, cfg.vocab_size, 32).tolist() for i in range(4)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = {}
    for k, m in models.items():
        eng = Engine(m, EngineConfig(page_size=16, max_seqs=4, max_tokens_per_step=64, max_model_len=64, warmup=False))
        tokens[k] = [o.token_ids for o in eng.generate(prompts, greedy, progress=False)]
        del eng
    same = sum(a == b for a, b in zip(tokens["fp8"], tokens["dequantized"]))
    ctx, steps = (64, 2) if small else (2048, 32)
    rows = []
    for batch in batches:
        tok_s = {}
        for k, m in models.items():
            eng = Engine(m, EngineConfig(page_size=16, max_seqs=batch, max_tokens_per_step=max(batch, 16),
                                         max_model_len=-(-(ctx + steps + 8) // 16) * 16, warmup=False))
            tok_s[k] = common.decode_with_synthetic_prefix(eng, batch, ctx, steps)
            del eng
        rows.append({"batch": batch, "context": ctx, "fp8_gb": held["fp8"] / 1e9, "deq_gb": held["dequantized"] / 1e9,
                     "fp8_tok_s": tok_s["fp8"], "deq_tok_s": tok_s["dequantized"],
                     "fp8_over_deq": tok_s["fp8"] / tok_s["dequantized"], "greedy_equal": f"{same}/{len(prompts)}"})
    return rows


def print_memory(res: dict) -> None:
    print(json.dumps(res, indent=1), flush=True)


def print_parity(res: dict) -> None:
    print({k: res[k] for k in ("engine_greedy_equals_reference", "pool_addresses_stable", "compilations",
                               "pallas_engine_greedy_equals_reference", "pallas_pool_addresses_stable")})


def table(columns):
    return functools.partial(common.print_markdown_table, columns)


PRINT_DECODE = table([
    ("model", "model", "s"), ("batch", "batch", "d"), ("context", "context", "d"), ("tok/s", "tok_s", ".0f"),
    ("step ms", "step_ms", ".2f"), ("roofline tok/s", "roofline_tok_s", ".0f"), ("of roofline", "of_roofline", ".2f"),
    ("slot tok/s", "slot_tok_s", ".0f"), ("slot / own", "slot_over_own", ".2f")])
PRINT_PROFILE = table([
    ("batch", "batch", "d"), ("context", "context", "d"), ("Engine.step ms", "engine_step_ms", ".2f"),
    ("runner.step ms", "runner_step_ms", ".2f"), ("tiling ms", "tiling_ms", ".2f"),
    ("jitted step ms", "device_ms", ".2f"), ("engine Python ms", "engine_python_ms", ".2f"),
    ("runner host ms", "runner_host_ms", ".2f")])
PRINT_SWITCH = table([
    ("weight-slot switch", "path", "s"), ("GB", "gb", ".2f"), ("best ms", "best_ms", ".2f"), ("GB/s", "gb_s", ".1f"),
    ("limit", "limit", "s"), ("limit GB/s", "limit_gb_s", ".1f"), ("of limit", "of_limit", ".2f")])
PRINT_RESTORE = table([
    ("prefix tokens", "context", "d"), ("host memory", "memory_kind", "s"), ("copy MB", "copy_mb", ".1f"),
    ("restore ms", "restore_ms", ".2f"), ("restore GB/s", "restore_gb_s", ".1f"),
    ("device_put H2D GB/s", "h2d_gb_s", ".1f"), ("restore / device_put", "restore_of_device_put", ".2f"),
    ("offload GB/s", "offload_gb_s", ".1f"), ("device_put D2H GB/s", "d2h_gb_s", ".1f"),
    ("offload / device_put", "offload_of_device_put", ".2f")])
PRINT_KERNEL = table([
    ("attention", "kind", "s"), ("batch", "batch", "d"), ("context", "context", "d"), ("tokens", "tokens", "d"),
    ("tile", "tile", "d"), ("pallas ms", "pallas_ms", ".3f"), ("reference ms", "reference_ms", ".3f"),
    ("speed-up", "speedup", ".2f"), ("max abs diff", "max_abs_diff", ".2e")])
PRINT_FP8 = table([
    ("batch", "batch", "d"), ("context", "context", "d"), ("fp8 GB", "fp8_gb", ".3f"),
    ("dequantized GB", "deq_gb", ".3f"), ("fp8 tok/s", "fp8_tok_s", ".0f"), ("dequantized tok/s", "deq_tok_s", ".0f"),
    ("fp8 / dequantized", "fp8_over_deq", ".2f"), ("greedy equal", "greedy_equal", "s")])
PRINT_PREFILL = table([
    ("cached tokens", "context", "d"), ("chunk", "chunk", "d"), ("chunk ms", "chunk_ms", ".2f"),
    ("chunk tok/s", "chunk_tok_s", ".0f"), ("recompute ms", "recompute_ms", ".1f"),
    ("recompute tok/s", "recompute_tok_s", ".0f"), ("recompute / chunk", "recompute_over_chunk", ".1f")])


def run_section(res: dict, key: str, fn, show, out: str, merge: bool = False) -> None:
    """res[key] = fn() (with `merge`: res.update(fn())), printed by show(); an exception is printed and
    recorded as res[key] = {"error": ...}, and the run goes on. Then res is written as JSON to `out`."""
    t = time.perf_counter()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 -- one run on a GPU machine: record the failure, run the rest
        traceback.print_exc()
        res[key] = {"error": f"{type(e).__name__}: {e}"}
        print(f"\n{key}: FAILED: {res[key]['error']}", flush=True)
    else:
        if merge:
            res.update(value)
        else:
            res[key] = value
        show(value)
    res.setdefault("seconds", {})[key] = time.perf_counter() - t
    print(f"[{key}: {res['seconds'][key]:.1f} s]", flush=True)
    common.write_json(out, res)


def main(argv):
    del argv
    small, reps, out = _SMALL.value, _REPS.value, _OUT.value
    batches = [int(b) for b in _BATCHES.value]
    res: dict = {}
    run_section(res, "memory", lambda: memory_checks(1 << (20 if small else 30)), print_memory, out, merge=True)
    sections = {
        "engine_parity": (engine_parity, print_parity, True),
        "decode": (lambda: decode_roofline(small, batches, res["hbm_copy_gb_s"]), PRINT_DECODE, False),
        "step_profile": (lambda: common.step_profile(bench_model(small), sorted({batches[0], batches[-1]}),
                                                     64 if small else 2048, steps=4 if small else 20),
                         PRINT_PROFILE, False),
        "weight_switch": (lambda: weight_switch(small, reps, res["hbm_copy_gb_s"], res.get("h2d_gb_s")), PRINT_SWITCH,
                          False),
        "host_restore": (lambda: host_kv_restore(small, reps), PRINT_RESTORE, False),
        "prefill_cached": (lambda: prefill_cached(small, reps), PRINT_PREFILL, False),
        "kernel": (lambda: kernel_speedup(small, batches, reps), PRINT_KERNEL, False),
        "fp8": (lambda: fp8_decode(small, batches), PRINT_FP8, False),
    }
    unknown = set(_SECTIONS.value) - set(sections)
    if unknown:
        raise app.UsageError(f"--sections: unknown {sorted(unknown)}; known: {', '.join(sections)}")
    for key, (fn, show, merge) in sections.items():
        if not _SECTIONS.value or key in _SECTIONS.value:
            run_section(res, key, fn, show, out, merge=merge)
    print(f"\ntotal {sum(res['seconds'].values()):.1f} s", flush=True)


if __name__ == "__main__":
    app.run(main)
