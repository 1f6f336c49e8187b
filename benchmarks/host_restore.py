"""A session's next turn: restore its prefix KV from host memory vs prefill the prefix again, and the
restore's copy against a bare `jax.device_put` of the same bytes.

Same engine, same weights: by default a small fp32 Llama (random init; hidden 256, 2 layers, 4 query
heads, 1 kv head of 64, FFN 512, vocab 32000: ~17.5M parameters, mostly embeddings; 1 KiB of KV per
token), small so that a 32K-token prefix is prefilled in about half a minute on a 2-core CPU;
`--hidden=768 --layers=12` is the ~125M model of the earlier 1K / 4K table. For each context length,
one request of `context` tokens finishes with keep_kv (its KV goes to host memory); then the next
turn, `context` + `--new_tokens` tokens, is served both ways:
  - TTFT: with `restore=` (pages copied back from host memory, only the new tokens prefilled) vs from
    scratch (the whole prompt prefilled in chunks of `--chunk`), timed from add_request to the first
    sampled token, best of `--reps` after an untimed run of each (it compiles), the two sides in turns;
  - copy GB/s: the host tier's restore alone (host-to-device copy and scatter into pool pages, until
    the pool is ready) vs a bare `jax.device_put` of an array of the copy's shape from the tier's host
    memory kind (`host_memory_kind`: pinned_host here) to device memory, and the offload (gather and
    device-to-host copy) vs a bare device_put the other way; bytes are the copy's (`HostKV.host_bytes`),
    best of `--copy_reps`, the four copies in turns. The load before and after and other processes'
    CPU use are printed (benchmarks/common.py `Machine`).

  .venv/bin/python -m benchmarks.host_restore --out=/tmp/host_restore.json
"""
from __future__ import annotations

import numpy as np
from absl import app, flags

from benchmarks import common

_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "4096", "32768"], "Prefix lengths (tokens).")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Tokens the next turn adds (the tool's observation).")
_CHUNK = flags.DEFINE_integer("chunk", 512, "Prefill chunk (token budget per step).")
_REPS = flags.DEFINE_integer("reps", 3, "Timed TTFT runs per side (best is reported).")
_COPY_REPS = flags.DEFINE_integer("copy_reps", 10, "Timed runs of each copy (best is reported).")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Model hidden size (768 with 12 layers: ~125M parameters).")
_LAYERS = flags.DEFINE_integer("layers", 2, "Model layers.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def main(argv):
    del argv
    import jax

    from talaria_jax.engine import Engine, EngineConfig, SamplingParams
    from talaria_jax.models import init_model
    from talaria_jax.sharding import make_mesh

    machine = common.Machine.start(common.set_threads(None, torch_side=False))
    contexts = [int(c) for c in _CONTEXTS.value]
    cfg = common.llama_config(_HIDDEN.value, _LAYERS.value, max_position=max(contexts) + _NEW.value + 64)
    model = init_model(cfg, make_mesh(jax.devices()[:1]), seed=0)
    page = 16
    eng = Engine(model, EngineConfig(page_size=page, max_seqs=2, max_tokens_per_step=_CHUNK.value,
                                     max_model_len=-(-(max(contexts) + _NEW.value + 8) // page) * page,
                                     warmup=False))  # compiles on first use: the best of the reps discards it
    rng = np.random.RandomState(0)
    rows = []
    for ctx in contexts:
        rid = eng.add_request(rng.randint(0, cfg.vocab_size, ctx - 1).tolist(),
                              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), keep_kv=True)
        while eng.has_unfinished():
            done = [o for o in eng.step() if o.request_id == rid and o.finished]
        kv = done[0].kv
        assert kv.num_tokens == ctx
        nxt = list(kv.token_ids) + done[0].token_ids[-1:] + rng.randint(0, cfg.vocab_size, _NEW.value - 1).tolist()
        best = common.interleave({"restore": lambda: common.ttft(eng, nxt, kv), "recompute": lambda: common.ttft(eng, nxt)},
                                 _REPS.value)
        restored, scratch = best["restore"], best["recompute"]
        t = common.copy_times(eng, kv, _COPY_REPS.value)
        gb = kv.host_bytes / 1e9
        rows.append(dict(context=ctx, new_tokens=_NEW.value, kv_mb=kv.nbytes / 1e6, copy_mb=kv.host_bytes / 1e6,
                         restore_ttft_s=restored, recompute_ttft_s=scratch, speedup=scratch / restored, **t,
                         restore_gb_s=gb / t["restore_s"], h2d_gb_s=gb / t["h2d_s"],
                         restore_vs_device_put=t["h2d_s"] / t["restore_s"], offload_gb_s=gb / t["offload_s"],
                         d2h_gb_s=gb / t["d2h_s"], offload_vs_device_put=t["d2h_s"] / t["offload_s"]))
        r = rows[-1]
        print(f"  ctx {ctx:6d}: KV {r['kv_mb']:7.1f} MB  TTFT restore {restored * 1e3:8.1f} ms  recompute "
              f"{scratch * 1e3:9.1f} ms  recompute/restore {r['speedup']:6.1f}  |  restore {r['restore_gb_s']:5.2f} "
              f"GB/s vs device_put {r['h2d_gb_s']:5.2f} GB/s  offload {r['offload_gb_s']:5.2f} GB/s vs device_put "
              f"{r['d2h_gb_s']:5.2f} GB/s", flush=True)
    machine.stop()
    print(f"\nhost memory kind {eng.host_tier.memory_kind}\n{machine.report()}")
    common.print_markdown_table(
        [("prefix tokens", "context", "d"), ("new tokens", "new_tokens", "d"), ("prefix KV (MB)", "kv_mb", ".1f"),
         ("TTFT, restore from host (s)", "restore_ttft_s", ".3f"), ("TTFT, recompute (s)", "recompute_ttft_s", ".3f"),
         ("recompute / restore", "speedup", ".1f")], rows)
    common.print_markdown_table(
        [("prefix tokens", "context", "d"), ("copy (MB)", "copy_mb", ".1f"), ("restore (ms)", "restore_s", ".2f"),
         ("restore GB/s", "restore_gb_s", ".2f"), ("device_put H2D GB/s", "h2d_gb_s", ".2f"),
         ("restore / device_put", "restore_vs_device_put", ".2f"), ("offload GB/s", "offload_gb_s", ".2f"),
         ("device_put D2H GB/s", "d2h_gb_s", ".2f"), ("offload / device_put", "offload_vs_device_put", ".2f")],
        [dict(r, restore_s=r["restore_s"] * 1e3) for r in rows])
    common.write_json(_OUT.value, dict(memory_kind=eng.host_tier.memory_kind, hidden=_HIDDEN.value,
                                       layers=_LAYERS.value, chunk=_CHUNK.value, rows=rows), machine)


if __name__ == "__main__":
    app.run(main)
