"""The compiled-step audit (`python -m benchmarks.step_audit`) on tiny-dense: compiled for this CPU at TP=1,
its numbers sane and following from the step's structure (kernels per step = fixed kernels + trips x
kernels per trip); lowered for CUDA; and compiled for an H200 where XLA's GPU compiler is installed."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from talaria_jax.engine.engine import EngineConfig
from talaria_jax.engine.runner import reference_blocks

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONTEXTS = (256, 1024)


def expected_trips(context: int, tile: int) -> int:
    """The attention loop's trips for sequences of `context` tokens, as the runner computes them."""
    ec = EngineConfig()
    blocks = -(-(-(-context // ec.page_size)) // ec.pages_per_block)
    return reference_blocks(tile, blocks, ec.pages_per_block)[0]


def test_step_audit_tiny_dense(tmp_path):
    out = tmp_path / "audit.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-m", "benchmarks.step_audit", "--models=tiny-dense", "--tp=1",
                          f"--contexts={','.join(map(str, CONTEXTS))}", "--batch=4", "--chunk=64", f"--out={out}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| decode | 1 | 256 |" in run.stdout and "| mixed | 1 | 1024 |" in run.stdout
    rows = json.loads(out.read_text())["models"]["tiny-dense"]
    by = {(r["step"], r["context"]): r for r in rows}
    assert set(by) == {(s, c) for s in ("decode", "mixed") for c in CONTEXTS}
    for r in rows:
        assert r["kernels"] > 0 and r["compile_s"] > 0 and r["exe_mb"] > 0
        assert r["bytes_accessed"] >= r["min_kv_bytes"] > 0 and r["min_bytes"] > r["min_kv_bytes"]
        assert r["collectives_per_layer"] == "0" and r["collectives_rest"] == "0"  # one device: none
        if r["runtime_loops"]:  # the reference attention's loop over page blocks
            assert r["trips"] == expected_trips(r["context"], r["tile"])
    for step in ("decode", "mixed"):  # recorded, whatever it is: the loop's trips times its kernels
        small, large = by[(step, CONTEXTS[0])], by[(step, CONTEXTS[1])]
        assert small["kernels_per_trip"] == large["kernels_per_trip"]
        assert large["kernels"] - small["kernels"] == (large["trips"] - small["trips"]) * small["kernels_per_trip"]



def test_the_sampler_gathers_sharded_logits_once_at_tp8(tmp_path):
    """At TP=8 the LM head's logits are sharded by vocabulary; the sampler's top-k / top-p search
    replicates them first, so the step outside its layers runs a handful of all-reduces, not one in
    each of the search's 64 passes (70 without the replication, measured)."""
    out = tmp_path / "audit_tp8.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.step_audit", "--models=tiny-dense", "--tp=8",
                          "--contexts=256", "--batch=4", "--chunk=64", f"--out={out}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["models"]["tiny-dense"]
    assert {(r["step"], r["tp"]) for r in rows} == {("decode", 8), ("mixed", 8)}
    for r in rows:
        assert r["collectives"].get("AR_rest", 0) < 16, r["collectives_rest"]


def test_a_loop_over_fixed_bounds_is_told_from_one_over_the_inputs():
    """`fixed_trips` reads a fori_loop's constant bound from its condition; a bound that is an input
    (the attention's page blocks) gives None, and `stablehlo_counts` counts the two apart."""
    import jax
    import jax.numpy as jnp

    from benchmarks.step_audit import fixed_trips, stablehlo_counts

    def f(x, n):
        return jax.lax.fori_loop(0, 32, lambda i, c: c * 2, x), jax.lax.fori_loop(0, n, lambda i, c: c + 1, x)

    text = jax.jit(f).lower(jnp.ones(3), 5).as_text()
    lines = text.splitlines()
    whiles = [i for i, line in enumerate(lines) if "stablehlo.while" in line]
    assert [fixed_trips(lines, i) for i in whiles] == [32, None]
    counts = stablehlo_counts(text)
    assert (counts["fixed_loops"], counts["loops"]) == (1, 1)


def _lowered(tmp_path, attention: str) -> list[dict]:
    out = tmp_path / f"lowered_{attention}.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.step_audit", "--lower_for=cuda", "--models=tiny-dense",
                          "--tp=1", f"--contexts={','.join(map(str, CONTEXTS))}", "--batch=4", "--chunk=64",
                          f"--attention={attention}", f"--out={out}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "lowered for cuda" in run.stdout
    return json.loads(out.read_text())["models"]["tiny-dense"]


def test_the_gpu_path_lowered_for_cuda_has_one_kernel_a_layer_and_no_loop(tmp_path):
    """The step lowered for CUDA on this machine: with the Pallas kernel ("auto" as on a GPU) each
    layer's attention is one Triton call and the program has no while loop, so a step runs the same
    kernels at every context; the reference lowered the same way keeps a loop over page blocks in
    every layer, which the audit reports as not flat (the check can fail)."""
    rows = _lowered(tmp_path, "auto")
    assert {(r["step"], r["context"]) for r in rows} == {(s, c) for s in ("decode", "mixed") for c in CONTEXTS}
    for r in rows:
        assert r["attention"] == "pallas" and r["flat"] and r["loops"] == 0
        assert r["fixed_loops"] >= 1  # the sampler's top-k / top-p search: 32 trips at every context
        assert r["triton_per_layer"] == 1 and r["triton"] == r["layers"] == 4
        assert 0 < r["ops_per_layer"] < r["ops"]
    for r in _lowered(tmp_path, "reference"):
        assert r["attention"] == "reference" and not r["flat"] and r["triton"] == 0
        assert r["loops_per_layer"] == 1


GPU_COMPILER = ROOT / ".venv-gpu-compiler" / "bin" / "python"


@pytest.mark.skipif(not GPU_COMPILER.exists(), reason="XLA's GPU compiler is not installed (make gpu-compiler)")
def test_the_step_compiled_for_an_h200_without_one(tmp_path):
    """XLA's GPU compiler run without a GPU (--target=h200, in the environment `make gpu-compiler`
    builds): the decode step runs the same kernels at 256 and 1024 tokens of context, one attention
    kernel a layer, and at TP=8 the layers' collectives are all-reduces (no all-gather of weights)."""
    out = tmp_path / "h200.json"
    run = subprocess.run([str(GPU_COMPILER), "-m", "benchmarks.step_audit", "--target=h200", "--models=tiny-dense",
                          "--tp=1,8", f"--contexts={','.join(map(str, CONTEXTS))}", "--batch=1", "--steps=decode",
                          f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["models"]["tiny-dense"]
    assert {(r["tp"], r["context"]) for r in rows} == {(tp, c) for tp in (1, 8) for c in CONTEXTS}
    for tp in (1, 8):
        small, large = (next(r for r in rows if r["tp"] == tp and r["context"] == c) for c in CONTEXTS)
        assert small["attention"] == "pallas" and small["runtime_loops"] == 0
        assert small["kernels"] == large["kernels"] and large["kernel_walk_bytes"] > small["kernel_walk_bytes"] > 0
    table = 512 * 256 * 2  # tiny-dense's embedding, bf16 on a GPU: all-gathered at batch 1 by a plain take
    for r in rows:
        assert set(r["collectives"]) <= {"AR_layers", "AR_rest", "AG_rest"}
        assert r["gathered_bytes"] < table / 8  # the sampler's candidates, never a weight
