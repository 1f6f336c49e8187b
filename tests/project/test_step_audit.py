"""The compiled-step audit (`python -m benchmarks.step_audit`) on tiny-dense at TP=1: its numbers are sane
and follow from the step's structure (kernels per step = fixed kernels + trips x kernels per trip)."""
import json
import os
import pathlib
import subprocess
import sys

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
