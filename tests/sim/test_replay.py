"""The talaria-replay entry point: flags, table, JSON, and clear errors."""
import json

import pytest
from absl import app, flags

from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.launch import replay as cli

TRACE = str(CONFIG_DIR / "traces" / "swebench-30x32.jsonl")


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
        _main("--seeds=x")


def test_cluster_replay_places_by_router():
    res = cli.run_replay(str(CONFIG_DIR / "traces" / "cluster-120x32.jsonl"), "h200x8", ["talaria"], [0], servers=4)
    assert res["policies"]["talaria"]["per_seed"][0]["calls"] == 3840


def _trace_file(tmp_path, rows, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps({"tool_gap_s": 0.5, **r}) + "\n" for r in rows))
    return str(p)


def test_unknown_model_is_one_line_with_file_and_line(tmp_path):
    import subprocess
    import sys
    trace = _trace_file(tmp_path, [
        {"session": "a", "turn": 0, "model": "qwen3-235b-a22b", "prompt_tokens": 100, "output_tokens": 10, "start_s": 0.0},
        {"session": "b", "turn": 0, "model": "gpt-5", "prompt_tokens": 100, "output_tokens": 10, "start_s": 0.0}])
    p = subprocess.run([sys.executable, "-m", "talaria_jax.launch.replay", f"--trace={trace}", "--policies=talaria",
                        "--seeds=0"], capture_output=True, text=True, cwd=str(CONFIG_DIR.parent), timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"talaria-replay: error: {trace}:2: model 'gpt-5' has no shape in the models table (known: ")
    assert "glm-4.5-air," in lines[0]  # config names count as models


def test_call_too_big_for_hbm_is_found_before_replay(tmp_path, capsys):
    trace = _trace_file(tmp_path, [
        {"session": "a", "turn": 0, "model": "qwen3-235b-a22b", "prompt_tokens": 100, "output_tokens": 10, "start_s": 0.0},
        {"session": "a", "turn": 1, "model": "qwen3-235b-a22b", "prompt_tokens": 10_000_000, "output_tokens": 10}])
    with pytest.raises(SystemExit) as e:
        _main(f"--trace={trace}", "--policies=talaria", "--seeds=0")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"talaria-replay: error: {trace}:2: call ('a', 1) needs 3850.2 GB of KV + 470.2 GB of weights, "
                   f"more than the usable HBM 1074.6 GB of h200x8\n")


def test_a_config_name_replays_in_bf16(tmp_path):
    # glm-4.5-air has no row in models.yaml (only glm-4.5-air-fp8): its config serves it in bf16
    trace = _trace_file(tmp_path, [
        {"session": "a", "turn": 0, "model": "glm-4.5-air", "prompt_tokens": 3000, "output_tokens": 200, "start_s": 0.0},
        {"session": "a", "turn": 1, "model": "glm-4.5-air", "prompt_tokens": 4000, "output_tokens": 100},
        {"session": "a", "turn": 2, "model": "glm-4.5-air", "prompt_tokens": 2500, "output_tokens": 100,
         "prefix_tokens": 2000}])
    res = cli.run_replay(trace, "h200x8", ["talaria"], [0])
    s = res["policies"]["talaria"]["per_seed"][0]
    assert s["calls"] == 3 and s["prefill_tokens"] == 3000 + 800 + 500
    assert s["peak_hbm_fraction"] > 213e9 / 1074.6e9  # 213.7 GB of bf16 weights on device


def test_replay_carries_the_agent_hints(tmp_path, capsys):
    out = tmp_path / "r.json"
    _main(f"--trace={TRACE}", "--policies=talaria", "--seeds=0", "--hints=true", f"--json_out={out}")
    res = json.loads(out.read_text())
    assert res["hints"] == "true" and ", hints true" in capsys.readouterr().out
    # told when each session ends, the scheduler reserves nothing for returns that never come
    none = cli.run_replay(TRACE, "h200x8", ["talaria"], [0], hints="none")["policies"]["talaria"]
    assert res["policies"]["talaria"]["sct_s"] != none["sct_s"]
    try:
        with pytest.raises(flags.IllegalFlagValueError, match="--hints=maybe: value should be one of <trace|none"):
            _main("--hints=maybe")
    finally:
        flags.FLAGS.unparse_flags()


def test_local_traces_and_the_worst_session_against_round():
    """The local replay's traces: 12 sessions of 4 and of 3 calls, mixed lengths, and sessions on two
    local models; a session's SCT is compared with its own under round in the same seed."""
    import collections

    from talaria_jax.local import LOCAL_MODELS, LOCAL_TRACES, local_trace

    calls = {k: collections.Counter(c.session for c in local_trace(spec)) for k, spec in LOCAL_TRACES.items()}
    assert set(calls["12x4"].values()) == {4} and set(calls["12x3"].values()) == {3}
    assert len(calls["mixed"]) == 12 and min(calls["mixed"].values()) <= 2 and max(calls["mixed"].values()) >= 8
    models = collections.defaultdict(set)
    for c in local_trace(LOCAL_TRACES["multi"]):
        models[c.session].add(c.model)
    assert sum(len(m) == 2 for m in models.values()) >= 6 and set().union(*models.values()) <= set(LOCAL_MODELS)
    runs = [{"a": 2.0, "b": 9.0}, {"a": 1.0, "b": 3.0}]
    base = [{"a": 1.0, "b": 10.0}, {"a": 4.0, "b": 1.0}]
    assert cli.worst_session_ratio(runs, base) == 3.0
