"""What a scan over layers costs a decode step on this backend, against the unrolled layers the decoder
runs: the SwiGLU MLP stack of a model's shape (its width, FFN width and depth; fp32 or bf16
weights), compiled both ways and timed at a few batch sizes.

- unrolled: one weight array per layer, a Python loop over layers (`models/decoder.py`'s form): the
  program grows with depth;
- scan: the layers' weights stacked on a leading axis and `jax.lax.scan` over it (one loop body
  whatever the depth); each iteration reads its layer's slice of the stacked weights.

The script prints compile seconds, the compiled program's kernel count (fusions and custom calls in
its text), the step time of each side (interleaved, best of --reps, after a warm-up), their ratio,
and whether a program copies weights before its dots (a kernel whose result is a layer's weight
matrix or the stack of them: the scanned program's slice of the stack, a `dynamic-slice` fusion,
since XLA:CPU's dot reads only whole buffers; or a conversion of bf16 weights to f32, on either
side) or reads them in place.

  .venv/bin/python -m benchmarks.scan_layers                       # SmolLM2-135M's MLP shapes
  .venv/bin/python -m benchmarks.scan_layers --hidden=2048 --ffn=5632 --layers=22   # the 1.1B shape

With --target=h100 or h200 both programs are compiled by XLA's GPU compiler for that GPU without one
(benchmarks/hlo_program.py; `make gpu-compiler`) and not run: per step, the kernels (a loop's body
counted once a trip) and the bytes its kernels move (`hlo_program.count`), against the weights.

  .venv-gpu-compiler/bin/python -m benchmarks.scan_layers --target=h200 --dtype=bfloat16 --hidden=2048 --ffn=5632 --layers=22
"""
from __future__ import annotations

import os
import time

from absl import app, flags

from benchmarks import common

_HIDDEN = flags.DEFINE_integer("hidden", 576, "Model width (SmolLM2-135M: 576).")
_FFN = flags.DEFINE_integer("ffn", 1536, "FFN width (SmolLM2-135M: 1536).")
_LAYERS = flags.DEFINE_integer("layers", 30, "Layers (SmolLM2-135M: 30).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "64"], "Tokens per step.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights' dtype.")
_REPS = flags.DEFINE_integer("reps", 20, "Timed reps per side and batch (best kept).")
_TARGET = flags.DEFINE_enum("target", "", ["", "h100", "h200"], "Compile for this GPU without one and read the "
                             "programs (no timing): XLA's deviceless GPU compile, benchmarks/hlo_program.py.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def _weight_copies(text: str, e: int, f: int, n: int) -> int:
    """Kernels of the compiled program (its text) whose result is one layer's weight matrix or the
    stack of them, in any float type: copies of weights (a slice of the stack, or a conversion, e.g.
    XLA:CPU's of bf16 weights to f32), where a dot that reads a weight where it lies needs none."""
    shapes = [f"[{e},{f}]", f"[{f},{e}]", f"[1,{e},{f}]", f"[1,{f},{e}]", f"[{n},{e},{f}]", f"[{n},{f},{e}]"]
    return sum(1 for line in text.splitlines()
               if " fusion(" in line and any(f"= {t}{s}" in line for t in ("f32", "bf16") for s in shapes))


def compiled_for_gpu(sides: dict, batches: list[int], e: int, f: int, n: int, dt, target: str) -> list[dict]:
    """Each side's program for each batch compiled for GPU `target` (no GPU): compile seconds, kernels
    per step and the bytes they move, against the weights' bytes."""
    import jax

    from benchmarks.hlo_program import count, parse_hlo, target_devices

    device = jax.sharding.SingleDeviceSharding(target_devices(target, 1)[0])
    shaped = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device)
    rows = []
    for b in batches:
        for name, (fn, w) in sides.items():
            t0 = time.perf_counter()
            compiled = fn.lower(jax.ShapeDtypeStruct((b, e), dt, sharding=device), jax.tree.map(shaped, w)).compile()
            hlo = parse_hlo(compiled.as_text())
            step = count(hlo, hlo.entry).at(0)
            rows.append({"batch": b, "program": name, "compile_s": time.perf_counter() - t0, "kernels": step["kernels"],
                         "moved_mb": step["bytes"] / 1e6,
                         "moved_over_weights": step["bytes"] / (3 * n * e * f * dt.itemsize),
                         "copies_weights": "yes" if _weight_copies(compiled.as_text(), e, f, n) else "no"})
    return rows


def main(argv):
    del argv
    if _TARGET.value:  # before jax loads: the host's CPU backend only, the GPU's devices come from its description
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    machine = common.Machine.start(os.cpu_count() or 1)
    import jax
    import jax.numpy as jnp

    e, f, n, dt = _HIDDEN.value, _FFN.value, _LAYERS.value, jnp.dtype(_DTYPE.value)
    key = jax.random.PRNGKey(0)
    gate, up, down = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32).astype(dt) * 0.02
                      for i, shape in enumerate([(n, e, f), (n, e, f), (n, f, e)]))
    per_layer = [tuple(w[i] for w in (gate, up, down)) for i in range(n)]

    def layer(x, w):
        g, u, d = w
        return x + (jax.nn.silu(x @ g) * (x @ u)) @ d

    @jax.jit
    def unrolled(x, ws):
        for w in ws:
            x = layer(x, w)
        return x

    @jax.jit
    def scanned(x, stacked):
        return jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0]

    sides = {"unrolled": (unrolled, per_layer), "scan": (scanned, (gate, up, down))}
    if _TARGET.value:
        rows = compiled_for_gpu(sides, [int(v) for v in _BATCHES.value], e, f, n, dt, _TARGET.value)
        machine.stop()
        print(f"MLP stack {n} x ({e} -> {f} -> {e}), {dt.name} weights ({3 * n * e * f * dt.itemsize / 1e6:.0f} MB), "
              f"compiled for {_TARGET.value} (no GPU; not run)")
        common.print_markdown_table([("batch", "batch", "d"), ("program", "program", ""),
                                     ("compile (s)", "compile_s", ".2f"),
                                     ("kernels", "kernels", "d"), ("MB moved", "moved_mb", ".1f"),
                                     ("moved / weights", "moved_over_weights", ".2f"),
                                     ("copies each layer's weights", "copies_weights", "")], rows)
        print(machine.report())
        common.write_json(_OUT.value, {"target": _TARGET.value, "rows": rows}, machine)
        return
    rows, programs = [], {}
    for b in [int(v) for v in _BATCHES.value]:
        x = jnp.ones((b, e), dt)
        compiled = {}
        for name, (fn, w) in sides.items():
            t0 = time.perf_counter()
            compiled[name] = fn.lower(x, w).compile()
            if name not in programs:
                text = compiled[name].as_text()
                programs[name] = {"compile_s": time.perf_counter() - t0,
                                  "kernels": text.count(" fusion(") + text.count(" custom-call("),
                                  "copies_weights": _weight_copies(text, e, f, n) > 0}

        def rep(name):
            c, w = compiled[name], sides[name][1]

            def run() -> float:
                t0 = time.perf_counter()
                c(x, w).block_until_ready()
                return time.perf_counter() - t0
            return run

        best = common.interleave({name: rep(name) for name in sides}, _REPS.value)
        rows.append({"batch": b, "unrolled_ms": best["unrolled"] * 1e3, "scan_ms": best["scan"] * 1e3,
                     "ratio": best["scan"] / best["unrolled"]})
    machine.stop()
    weights_mb = 3 * n * e * f * dt.itemsize / 1e6
    print(f"MLP stack {n} x ({e} -> {f} -> {e}), {dt.name} weights ({weights_mb:.0f} MB), backend "
          f"{jax.default_backend()}\n")
    print(common.markdown_header(["program", "compile (s)", "kernels", "copies each layer's weights"]))
    for name, p in programs.items():
        print(f"| {name} | {p['compile_s']:.2f} | {p['kernels']} | {'yes' if p['copies_weights'] else 'no'} |")
    print()
    common.print_markdown_table([("batch", "batch", "d"), ("unrolled ms", "unrolled_ms", ".2f"),
                                 ("scan ms", "scan_ms", ".2f"), ("scan / unrolled", "ratio", ".2f")], rows)
    print(f"\ncompile time scan / unrolled: {programs['scan']['compile_s'] / programs['unrolled']['compile_s']:.2f}")
    print(machine.report())
    common.write_json(_OUT.value, {"programs": programs, "rows": rows, "weights_mb": weights_mb}, machine)


if __name__ == "__main__":
    app.run(main)
