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
    assert "| talaria |" in table and "| round |" in table and "| floor (any policy) |" in table
    f = res["floor"]
    assert 0 < f["sct_p50_s"] < res["policies"]["talaria"]["sct_p50_s"]
    assert res["speedup_ceiling"]["round"]["p50"] == pytest.approx(res["policies"]["round"]["sct_p50_s"] / f["sct_p50_s"])
    json.dumps(res)


def test_tool_gap_scale_moves_only_tool_time():
    full = cli.run_replay(TRACE, "h200x8", ["round"], [0])
    none = cli.run_replay(TRACE, "h200x8", ["round"], [0], tool_gap_scale=0.0)
    assert none["tool_gap_scale"] == 0.0 and "tool gaps x0" in cli.format_table(none)
    # without tool time the floor is the service floor alone: well under the default's ~300 s
    assert none["floor"]["sct_p50_s"] < 0.2 * full["floor"]["sct_p50_s"]
    assert none["policies"]["round"]["sct_p50_s"] < full["policies"]["round"]["sct_p50_s"]
    with pytest.raises(ValueError, match="tool_gap_scale=-1"):
        cli.run_replay(TRACE, "h200x8", ["round"], [0], tool_gap_scale=-1.0)


def _main(*argv):
    flags.FLAGS(["replay", *argv])
    try:
        cli.main(["replay"])
    finally:
        flags.FLAGS.unparse_flags()


def test_main_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    _main(f"--trace={TRACE}", "--policies=talaria,composite", "--seeds=0", f"--json_out={out}")
    res = json.loads(out.read_text())
    assert set(res["policies"]) == {"talaria", "composite"}
    assert "| composite |" in capsys.readouterr().out


def test_bad_flags_give_clear_errors():
    with pytest.raises(app.UsageError, match="unknown policy 'fastest'"):
        _main("--policies=talaria,fastest")
    with pytest.raises(app.UsageError, match="--tool_gap_scale=-0.5 must be >= 0"):
        _main("--tool_gap_scale=-0.5")
    with pytest.raises(app.UsageError, match="--seeds: 'x' is not an integer"):
        cli._parse_seeds(["x"])


def test_cluster_replay_places_by_router():
    res = cli.run_replay(str(CONFIG_ROOT / "traces" / "cluster-120x32.jsonl"), "h200x8", ["talaria"], [0], servers=4)
    assert res["policies"]["talaria"]["per_seed"][0]["calls"] == 3840
