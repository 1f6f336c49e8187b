"""One prepared GPU check for a session that is lent a device (`benchmarks/device_check.sh` runs it).

On the accelerator it measures, in one run:
  1. what JAX sees (backend, devices, memory kinds) and whether `pinned_host` works, with H2D / D2H
     bandwidth of a device_put between a device sharding and a pinned_host sharding;
  2. HBM copy bandwidth (a jitted read + write of a large buffer);
  3. the paged engine on the accelerator: tiny-dense fp32 greedy output equals the full-sequence
     reference, the KV pool keeps its buffer addresses across steps;
  4. decode step time of a ~1B-parameter bf16 Llama-shaped model at several batch sizes from a
     synthetic 2K-token KV prefix, against the HBM roofline (weight + KV bytes per step over the
     measured copy bandwidth), and the same decode with the parameters carved out of an instance's
     flat weight slot (talaria_jax/weights/slot.py): on CPU the carve copies every parameter each
     step (~4x slower); whether XLA:GPU reads the slot in place is what the slot/own column shows.
Prints a table and writes JSON to --out. `--small` shrinks every size so that the script runs on a
CPU in seconds (tests/test_device_check.py keeps it from rotting).
"""
from __future__ import annotations

import json

from absl import app, flags

import common

_OUT = flags.DEFINE_string("out", "/tmp/device_check.json", "Write the results as JSON here.")
_SMALL = flags.DEFINE_bool("small", False, "Tiny sizes (a CPU smoke run).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32", "64"], "Decode batch sizes.")


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
    eng = Engine(model, EngineConfig(page_size=8, max_seqs=4, max_tokens_per_step=32, max_model_len=128,
                                     warmup=False))
    before = buffer_pointers(eng.runner.kv)
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), progress=False)
    return {"engine_greedy_equals_reference": [o.token_ids for o in outs] == ref,
            "pool_addresses_stable": buffer_pointers(eng.runner.kv) == before,
            "engine_steps": eng.stats.steps, "compilations": eng.runner.compilations}


def decode_roofline(small: bool, batches: list[int], hbm_gb_s: float) -> list[dict]:
    import jax

    from talaria_jax.engine import Engine, EngineConfig
    from talaria_jax.models import ModelConfig, init_model
    from talaria_jax.sharding import make_mesh

    if small:
        cfg = ModelConfig(name="small", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=32, ffn_size=256, dtype="float32", weight_dtype="float32", kv_dtype="float32")
        ctx, steps = 64, 2
    else:  # ~1.1B parameters, Llama-shaped, bf16 weights and KV
        cfg = ModelConfig(name="llama-1b-shape", vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16,
                          num_kv_heads=8, head_dim=128, ffn_size=5632, dtype="bfloat16", weight_dtype="bfloat16",
                          kv_dtype="bfloat16")
        ctx, steps = 2048, 32
    from talaria_jax.weights.slot import HostWeights, SlotLayout, WeightSlot

    model = init_model(cfg, make_mesh(jax.devices()[:1]), seed=0)
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


def main(argv):
    del argv
    small = _SMALL.value
    res = memory_checks(1 << (20 if small else 30))
    print(json.dumps(res, indent=1), flush=True)
    res.update(engine_parity())
    print({k: res[k] for k in ("engine_greedy_equals_reference", "pool_addresses_stable", "compilations")}, flush=True)
    res["decode"] = decode_roofline(small, [int(b) for b in _BATCHES.value], res["hbm_copy_gb_s"])
    print("\n| model | batch | context | tok/s | step ms | roofline tok/s | of roofline | slot tok/s | slot / own |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["decode"]:
        print(f"| {r['model']} | {r['batch']} | {r['context']} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | "
              f"{r['roofline_tok_s']:.0f} | {r['of_roofline']:.2f} | {r['slot_tok_s']:.0f} | {r['slot_over_own']:.2f} |")
    with open(_OUT.value, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    app.run(main)
