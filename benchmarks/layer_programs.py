"""Steps as layer programs on XLA:CPU: compile time, memory maps and decode speed by layers per program.

`EngineConfig.layers_per_program` = n runs a step as an embedding program, programs of n layers (one
compiled program serving every run of n like layers: the layer index is an argument) and a program
for the final norm, the logits and the draw; 0 compiles the whole step as one program, as on a GPU.
For each n of --values this script builds the engine over the same weights (no persistent cache)
and measures, for one decode step shape (--batch sequences, no warm-up of other shapes):

- compile s: tracing, lowering and compiling the programs that shape runs (the backend compile of
  each, one after another);
- programs: how many that is; maps added: the memory maps (/proc/self/maps) the compile added;
- decode ms: a decode step at each context of --contexts (`common.synthetic_decode`: the pages of
  --batch sequences of that context held, each rep --steps steps), the values timed in turns (one
  rep of each, the order reversed every other round), best of --reps.

  .venv/bin/python -m benchmarks.layer_programs                      # SmolLM2-135M, n = 0, 1, 2, 3, 5, 6, 10, 15, 30
  .venv/bin/python -m benchmarks.layer_programs --values=0,5 --batch=1 --contexts=512
  .venv/bin/python -m benchmarks.layer_programs --model=llama-1b-shape --compile_only
"""
from __future__ import annotations

import time

from absl import app, flags

from benchmarks import common

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Named model, .gguf file or HF folder (fp32), or "
                             "llama-1b-shape (the GPU check's ~1.1B bf16 Llama shape, random weights).")
_VALUES = flags.DEFINE_list("values", ["0", "1", "2", "3", "5", "6", "10", "15", "30"],
                            "layers_per_program values (0: the whole step one program).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences of each decode step.")
_CONTEXTS = flags.DEFINE_list("contexts", ["512", "2048"], "Tokens of each sequence's cached context.")
_STEPS = flags.DEFINE_integer("steps", 8, "Decode steps per rep.")
_REPS = flags.DEFINE_integer("reps", 5, "Reps per value and context (best kept).")
_COMPILE_ONLY = flags.DEFINE_bool("compile_only", False, "Compile and count only; no decode timing.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def engine(model, n: int, max_model_len: int):
    from talaria_jax.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(max_seqs=_BATCH.value, max_tokens_per_step=max(_BATCH.value, 16),
                                      max_model_len=max_model_len, warmup=False, layers_per_program=n))


def compile_shape(eng) -> dict:
    """Compiles the programs of the engine's decode step shape (`--batch` tokens in tiles of one)."""
    from talaria_jax.engine.memory_maps import map_count
    from talaria_jax.engine.runner import query_tiles

    r = eng.runner
    t = r.bucket(_BATCH.value)
    maps = map_count()
    t0 = time.perf_counter()
    lowered = r._programs(r.empty_batch(t), query_tiles([], t, 1, t), None, set())
    for p in lowered:
        p.compile()
    return dict(compile_s=time.perf_counter() - t0, programs=len(lowered), maps_added=map_count() - maps)


def main(argv):
    del argv
    import tempfile

    machine = common.Machine.start(common.set_threads(None, torch_side=False))
    values = [int(v) for v in _VALUES.value]
    contexts = [] if _COMPILE_ONLY.value else [int(c) for c in _CONTEXTS.value]
    steps, reps = _STEPS.value, _REPS.value
    if _MODEL.value == "llama-1b-shape":
        import jax

        from talaria_jax.models import init_model
        from talaria_jax.sharding import make_mesh

        model = init_model(common.llama_1b_shape(), make_mesh(jax.devices()[:1]))
        n_params = model.cfg.param_count()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model, _, n_params = common.bench_models(_MODEL.value, 0, 0, tmp)
    print(f"{_MODEL.value}: {model.cfg.num_layers} layers, {n_params / 1e6:.0f}M parameters {model.cfg.dtype}; decode of "
          f"{_BATCH.value} sequences; {machine.report()}", flush=True)
    rows, kept = {}, []
    for n in values:  # compile first, each value on its own engine (no persistent cache: a cold compile),
        kept.append(engine(model, n, 256))  # kept, so no earlier program is unmapped during a later count
        rows[n] = dict(layers_per_program=n, **compile_shape(kept[-1]))
        print(f"  n={n:2d}: {rows[n]['programs']} programs, compile {rows[n]['compile_s']:.2f} s, "
              f"{rows[n]['maps_added']} maps", flush=True)
    del kept
    for ctx in contexts:
        max_len = -(-(ctx + steps * (reps + 3) + 8) // 16) * 16
        sides = {n: common.synthetic_decode(engine(model, n, max_len), _BATCH.value, ctx, steps, reps)
                 for n in values}
        best = common.interleave(sides, reps)
        for n in values:
            rows[n][f"decode_ms_{ctx}"] = best[n] / steps * 1e3
        print(f"  context {ctx}: " + ", ".join(f"n={n} {best[n] / steps * 1e3:.1f} ms" for n in values), flush=True)
    machine.stop()
    whole = rows.get(0)
    cols = [("layers per program", "layers_per_program", "d"), ("programs", "programs", "d"),
            ("compile s", "compile_s", ".2f"), ("maps added", "maps_added", "d")]
    cols += [(f"decode ms, {c} tokens", f"decode_ms_{c}", ".1f") for c in contexts]
    if whole:
        for r in rows.values():
            for c in contexts:
                r[f"vs_whole_{c}"] = r[f"decode_ms_{c}"] / whole[f"decode_ms_{c}"]
        cols += [(f"/ one program, {c}", f"vs_whole_{c}", ".2f") for c in contexts]
    common.print_markdown_table(cols, list(rows.values()))
    print(machine.report())
    common.write_json(_OUT.value, dict(model=_MODEL.value, batch=_BATCH.value, steps=steps, reps=reps,
                                       rows=list(rows.values())), machine)


if __name__ == "__main__":
    app.run(main)
