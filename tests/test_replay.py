"""The talaria-replay entry point: flags, table, JSON, and clear errors."""
import json

import pytest
from absl import app, flags

from talaria_jax.launch import replay as cli
from talaria_jax.sim.hardware import CONFIG_ROOT

TRACE = str(CONFIG_ROOT / "traces" / "swebench-30x32.jsonl")


def test_run_replay_json_and_table():
    res = cli.run_replay(TRACE, "h200x8", ["talaria", "round"], [0, 1])
    for name in ("talaria", "round"):
        v = res["policies"][name]
        assert v["sct_p50_s"] <= v["sct_p95_s"] and len(v["per_seed"]) == 2
    assert res["talaria_speedup"]["round"]["p50"] > 1.0
    table = cli.format_table(res)
    assert "| talaria |" in table and "| round |" in table
    json.dumps(res)


def test_main_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    flags.FLAGS(["replay", f"--trace={TRACE}", "--policies=talaria,composite", "--seeds=0", f"--json_out={out}"])
    try:
        cli.main(["replay"])
    finally:
        flags.FLAGS.unparse_flags()
    res = json.loads(out.read_text())
    assert set(res["policies"]) == {"talaria", "composite"}
    assert "| composite |" in capsys.readouterr().out


def test_bad_flags_give_clear_errors():
    flags.FLAGS(["replay", "--policies=talaria,fastest"])
    try:
        with pytest.raises(app.UsageError, match="unknown policy 'fastest'"):
            cli.main(["replay"])
    finally:
        flags.FLAGS.unparse_flags()
    with pytest.raises(app.UsageError, match="--seeds: 'x' is not an integer"):
        cli._parse_seeds(["x"])


def test_cluster_replay_places_by_router():
    res = cli.run_replay(str(CONFIG_ROOT / "traces" / "cluster-120x32.jsonl"), "h200x8", ["talaria"], [0], servers=4)
    assert res["policies"]["talaria"]["per_seed"][0]["calls"] == 3840
