"""The prepared device check (`python -m benchmarks.device_check`) runs end to end in its CPU smoke mode."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import FAST_COMPILE

pytestmark = pytest.mark.slow  # real servers, SmolLM2 or child processes: not in the fast subset

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = dict(os.environ, XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu")


def test_device_check_small_runs_on_cpu(tmp_path):
    out = tmp_path / "dc.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--small", "--batches=2", "--reps=1",
                          f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["engine_greedy_equals_reference"] and res["pool_addresses_stable"]
    assert res["pallas_engine_greedy_equals_reference"] and res["pallas_pool_addresses_stable"]  # interpreted
    assert res["hbm_copy_gb_s"] > 0 and res["decode"][0]["batch"] == 2 and res["decode"][0]["tok_s"] > 0
    assert "| small | 2 |" in run.stdout
    # the sections added for the GPU: each a list of rows, none failed
    switch = {r["path"].split()[0]: r for r in res["weight_switch"]}
    assert set(switch) == {"activate_staged", "load", "staging"}
    assert all(r["gb_s"] > 0 and r["limit_gb_s"] > 0 and r["of_limit"] > 0 for r in switch.values())
    assert [r["context"] for r in res["host_restore"]] == [64, 128]
    assert all(r["restore_gb_s"] > 0 and r["offload_gb_s"] > 0 for r in res["host_restore"])
    if "pinned_host" in res["memory_kinds"]:
        assert all(r["h2d_gb_s"] > 0 and r["restore_of_device_put"] > 0 for r in res["host_restore"])
    assert [r["context"] for r in res["prefill_cached"]] == [64, 128]
    assert all(r["chunk_tok_s"] > 0 and r["recompute_ms"] > 0 for r in res["prefill_cached"])
    (prof,) = res["step_profile"]  # --batches=2: one batch size
    assert prof["batch"] == 2 and all(prof[k] > 0 for k in ("engine_step_ms", "runner_step_ms", "device_ms"))
    kernel = res["kernel"]  # the Pallas kernel, interpreted on CPU: its outputs match the reference's
    assert [(r["kind"], r["context"]) for r in kernel] == [("decode", 64), ("decode", 128), ("prefill", 64)]
    assert all(r["pallas_ms"] > 0 and r["reference_ms"] > 0 and r["max_abs_diff"] < 1e-4 for r in kernel)
    (fp8,) = res["fp8"]  # FP8-stored weights against the same weights dequantized: the same tokens, fewer bytes
    assert fp8["greedy_equal"] == "4/4" and fp8["fp8_tok_s"] > 0 and fp8["deq_tok_s"] > 0
    assert fp8["fp8_gb"] < fp8["deq_gb"]
    assert set(res["seconds"]) == {"memory", "engine_parity", "decode", "step_profile", "weight_switch",
                                   "host_restore", "prefill_cached", "kernel", "fp8"}
    for header in ("| weight-slot switch |", "| prefix tokens |", "| cached tokens |", "| attention |", "| fp8 GB |"):
        assert header in run.stdout


def test_a_failed_section_is_recorded_and_the_next_runs(tmp_path):
    out = tmp_path / "dc.json"
    script = f"""
from benchmarks import device_check as dc
res = {{}}
dc.run_section(res, "broken", lambda: 1 / 0, print, {str(out)!r})
dc.run_section(res, "fine", lambda: [{{"x": 1}}], print, {str(out)!r})
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["broken"] == {"error": "ZeroDivisionError: division by zero"} and res["fine"] == [{"x": 1}]
    assert set(res["seconds"]) == {"broken", "fine"} and "broken: FAILED" in run.stdout


def test_weights_import_without_the_gguf_package():
    """The device machine has no `gguf`: talaria_jax.weights (slot, named, the engine) still imports, and
    reading a GGUF file says in one line what is missing."""
    script = """
import sys
sys.modules["gguf"] = None  # import gguf now raises ModuleNotFoundError
import talaria_jax.engine, talaria_jax.weights.named, talaria_jax.weights.slot
from talaria_jax.weights import CheckpointError, load_gguf
try:
    load_gguf("model.gguf")
except CheckpointError as e:
    assert isinstance(e, ImportError), type(e)
    print("ERROR:", e)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "ERROR: reading GGUF files needs the gguf package: pip install gguf"
