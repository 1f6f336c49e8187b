"""Decode throughput of the paged engine vs HF transformers `generate` vs the memory roofline.

One run, same weights on both sides: a ~125M-parameter fp32 Llama (random init, saved as HF
safetensors and loaded through talaria_jax's loader). For each batch size and context, both sides
start from a synthetic KV prefix of `context` tokens (random tensors in HF's DynamicCache; the
paged pool's pages for ours) so that only decode-shaped steps are timed, then generate
`--decode_steps` tokens per sequence greedily. Roofline: (fp32 weight bytes + KV bytes read per
step) over the copy bandwidth measured in the same run (numpy copy, read + write bytes, as STREAM
counts), i.e. the best a memory-bound decode step can do on this machine.

Fair by construction (benchmarks/common.py): both sides run on the same cores (`--threads`, default
all: the process is pinned to them and torch uses as many threads), each point times `--reps` reps
of `--decode_steps` steps per side in turns (ours, HF, HF, ours, ...) and keeps the best of each, and
the run prints the load average before and after and the CPU other processes took, with a warning
when that was more than a quarter of a core. HF's rep is clocked inside `generate` (a logits
processor stamps each step), so its cache setup and first step are not counted, as ours are not.

  .venv/bin/python -m benchmarks.engine_decode --out=/tmp/engine_decode.json
  .venv/bin/python -m benchmarks.engine_decode --model=smollm2-135m-instruct   # the embedded real model
  .venv/bin/python -m benchmarks.engine_decode --step_profile --contexts=2048 --skip_hf   # where a step's time goes

With `--model` (a named model, a .gguf file or an HF checkpoint folder) both sides load that model
instead: ours through `talaria_jax.weights.load_model`, HF through `from_pretrained` (with
`gguf_file=` for a GGUF, which transformers dequantizes to fp32 as we do).

Where the gap to the roofline comes from (CPU, 2 cores): the step's attention is the plain-jnp
reference (a gather of each sequence's pages per block, then two einsums), so at long contexts the
KV is read twice (gather + use) and XLA:CPU runs the gathers single-threaded; at batch 1 the step
is a chain of small matmuls whose fixed per-op cost on XLA:CPU is comparable to their memory time.
The Pallas kernel (talaria_jax/engine/kernels/, the default on GPU) reads pages in place and so
removes the first there; on CPU it only runs interpreted. The second is CPU-specific. Ours decodes
from a context that grows over its reps (each rep continues the same sequences, about
(reps / 2 + 1) x steps tokens more than `context` on average), HF's from a fresh `context`-token
cache each rep: the difference (~12% more KV at context 512 with the defaults) counts against ours.
"""
from __future__ import annotations

import tempfile
import time
import warnings

from absl import app, flags

from benchmarks import common

_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32"], "Batch sizes.")
_CONTEXTS = flags.DEFINE_list("contexts", ["512", "2048"], "Context lengths (tokens already in the KV cache).")
_STEPS = flags.DEFINE_integer("decode_steps", 16, "Timed decode steps per rep.")
_REPS = flags.DEFINE_integer("reps", 3, "Reps per side and point, interleaved with the other side's (best is reported).")
_THREADS = flags.DEFINE_integer("threads", None, "Cores for both sides (default: all): this process is pinned to "
                                "them (XLA:CPU sizes its pool by them) and torch uses as many threads.")
_HIDDEN = flags.DEFINE_integer("hidden", 768, "Model hidden size (768 with 12 layers: ~125M parameters).")
_LAYERS = flags.DEFINE_integer("layers", 12, "Model layers.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")
_BASELINE = flags.DEFINE_integer("baseline_layers_per_program", None, "Also time our engine with this "
                                 "EngineConfig.layers_per_program (0: each step one program), a third side in turns.",
                                 lower_bound=0)
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "Do not run the HF side (when torch is not installed).")
_PROFILE = flags.DEFINE_bool("step_profile", False, "Instead of the comparison: where our decode step's time goes "
                              "(Engine.step, runner.step, the jitted step alone) at each batch, the first context.")
_MODEL = flags.DEFINE_string("model", None, "Named model, .gguf file or HF folder to load on both sides "
                             "(default: a random ~125M Llama of --hidden/--layers).")


def copy_bandwidth(nbytes: int = 1 << 29, reps: int = 5) -> float:
    """Best-of-n numpy copy bandwidth in bytes/s, counting read + write."""
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def ours_rep(model, batch: int, ctx: int, steps: int, reps: int, layers_per_program: int | None = None):
    """A rep (seconds of `steps` decode steps) of our engine over a synthetic `ctx`-token prefix."""
    from talaria_jax.engine import Engine, EngineConfig

    page = 16  # synthetic_decode warms up the shapes it times: no engine warm-up
    eng = Engine(model, EngineConfig(page_size=page, max_seqs=batch, max_tokens_per_step=max(batch, 16),
                                     max_model_len=-(-(ctx + steps * (reps + 2) + 8) // page) * page, warmup=False,
                                     layers_per_program=layers_per_program))
    return common.synthetic_decode(eng, batch, ctx, steps, reps)


def hf_rep(model, batch: int, ctx: int, steps: int):
    """A rep (seconds of `steps` decode steps) of transformers `generate` over a DynamicCache of `ctx`
    random tokens: a logits processor clocks each step, and the time from the first step's logits to the
    last's is `steps` decode forwards with their sampling (the cache is built outside the clock)."""
    import torch
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

    cfg = model.config

    class Clock(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def rep() -> float:
        cache = DynamicCache(config=cfg)
        g = torch.Generator().manual_seed(0)
        for layer in range(cfg.num_hidden_layers):
            shape = (batch, cfg.num_key_value_heads, ctx, cfg.head_dim)
            cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), layer)
        ids = torch.randint(0, cfg.vocab_size, (batch, ctx + 1), generator=g)
        clock = Clock()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)  # transformers 5
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([clock]))
        assert out.shape[1] == ctx + 2 + steps and len(clock.times) == steps + 1
        return clock.times[-1] - clock.times[0]

    return rep


def main(argv):
    del argv
    threads = common.set_threads(_THREADS.value, torch_side=not _SKIP_HF.value)
    machine = common.Machine.start(threads)
    points = [(int(b), int(c)) for c in _CONTEXTS.value for b in _BATCHES.value]
    bw = copy_bandwidth()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ours_model, path, n_params = common.bench_models(_MODEL.value, _HIDDEN.value, _LAYERS.value, tmp)
        cfg = ours_model.cfg
        layers, kv_heads, head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        if _PROFILE.value:
            rows = common.step_profile(ours_model, [b for b, _ in points[:len(_BATCHES.value)]], points[0][1], steps=8)
            common.print_markdown_table([("batch", "batch", "d"), ("context", "context", "d"),
                                         ("Engine.step ms", "engine_step_ms", ".1f"), ("runner.step ms", "runner_step_ms", ".1f"),
                                         ("jitted step ms", "device_ms", ".1f"), ("host work ms", "host_ms", ".1f")],
                                        [dict(r, host_ms=r["engine_step_ms"] - r["device_ms"]) for r in rows])
            return
        theirs_model = None if _SKIP_HF.value else common.load_hf(path)
        kv_per_token = 2 * layers * kv_heads * head_dim * 4
        print(f"model: {n_params / 1e6:.0f}M params fp32, KV {kv_per_token} B/token; copy bandwidth {bw / 1e9:.1f} GB/s; "
              f"{_STEPS.value} decode steps per rep, best of {_REPS.value} reps per side, interleaved")
        print(machine.report(), flush=True)
        steps = _STEPS.value
        for batch, ctx in points:
            sides = {"ours": ours_rep(ours_model, batch, ctx, steps, _REPS.value)}
            if _BASELINE.value is not None:
                sides["baseline"] = ours_rep(ours_model, batch, ctx, steps, _REPS.value, _BASELINE.value)
            if theirs_model is not None:
                sides["hf"] = hf_rep(theirs_model, batch, ctx, steps)
            best = common.interleave(sides, _REPS.value)
            ours = batch * steps / best["ours"]
            theirs = batch * steps / best["hf"] if "hf" in best else None
            base = batch * steps / best["baseline"] if "baseline" in best else None
            step_bytes = n_params * 4 + batch * (ctx + steps * _REPS.value / 2) * kv_per_token
            roof = batch / (step_bytes / bw)
            rows.append(dict(batch=batch, context=ctx, ours_tok_s=ours, hf_tok_s=theirs, roofline_tok_s=roof,
                             ours_over_hf=(ours / theirs) if theirs else None, ours_over_roofline=ours / roof,
                             baseline_tok_s=base, ours_over_baseline=(ours / base) if base else None))
            r = rows[-1]
            print(f"  batch {batch:3d} ctx {ctx:5d}: ours {ours:8.1f} tok/s  hf {theirs or float('nan'):8.1f}  "
                  f"roofline {roof:8.1f}  ours/hf {r['ours_over_hf'] or float('nan'):5.2f}  "
                  f"ours/roofline {r['ours_over_roofline']:5.2f}"
                  + (f"  baseline {base:8.1f}  ours/baseline {ours / base:5.2f}" if base else ""), flush=True)
    machine.stop()
    common.print_markdown_table(
        [("batch", "batch", "d"), ("context", "context", "d"), ("ours tok/s", "ours_tok_s", ".1f"),
         ("HF tok/s", "hf_tok_s", ".1f"), ("roofline tok/s", "roofline_tok_s", ".1f"), ("ours/HF", "ours_over_hf", ".2f"),
         ("ours/roofline", "ours_over_roofline", ".2f")]
        + ([(f"ours, layers_per_program={_BASELINE.value} tok/s", "baseline_tok_s", ".1f"),
            ("ours/that", "ours_over_baseline", ".2f")] if _BASELINE.value is not None else []), rows)
    ratios = [r["ours_over_hf"] for r in rows if r["ours_over_hf"]]
    geomean = common.geomean(ratios) if ratios else None
    if geomean:
        print(f"\ngeometric mean ours/HF {geomean:.2f}")
    over_baseline = None
    if _BASELINE.value is not None:
        over_baseline = common.geomean([r["ours_over_baseline"] for r in rows])
        print(f"geometric mean ours over layers_per_program={_BASELINE.value} {over_baseline:.2f}")
    print(machine.report())
    common.write_json(_OUT.value, dict(model=_MODEL.value or "random-llama", params=n_params, copy_bandwidth_bytes_s=bw,
                                       decode_steps=steps, reps=_REPS.value, rows=rows, geomean_ours_over_hf=geomean,
                                       baseline_layers_per_program=_BASELINE.value,
                                       geomean_ours_over_baseline=over_baseline),
                      machine)


if __name__ == "__main__":
    app.run(main)
