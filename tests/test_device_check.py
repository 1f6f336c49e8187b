"""The prepared device check (benchmarks/device_check.py) runs end to end in its CPU smoke mode."""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_device_check_small_runs_on_cpu(tmp_path):
    out = tmp_path / "dc.json"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--small", "--batches=2",
                          f"--out={out}"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["engine_greedy_equals_reference"] and res["pool_addresses_stable"]
    assert res["hbm_copy_gb_s"] > 0 and res["decode"][0]["batch"] == 2 and res["decode"][0]["tok_s"] > 0
    assert "| small | 2 |" in run.stdout
