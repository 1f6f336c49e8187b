"""The trace format and generator: validation with line numbers, determinism, the default trace."""
import dataclasses
import json

import pytest

from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.scheduler import Hints
from talaria_jax.scheduler.session import reusable_prefixes
from talaria_jax.sim.traces import (TraceError, TraceSpec, generate, parse_jsonl, read_jsonl, summary, with_hints,
                                    write_jsonl)

GOOD = [
    {"session": "s0", "turn": 0, "model": "m1", "prompt_tokens": 100, "output_tokens": 10, "tool_gap_s": 1.0,
     "start_s": 0.0, "extra": "ignored"},
    {"session": "s0", "turn": 1, "model": "m1", "prompt_tokens": 150, "output_tokens": 10, "tool_gap_s": 0.0},
]


def _lines(rows):
    return [json.dumps(r) for r in rows]


def test_parses_and_ignores_unknown_fields():
    calls = parse_jsonl(_lines(GOOD))
    assert [c.key for c in calls] == [("s0", 0), ("s0", 1)]
    assert calls[0].start_s == 0.0 and calls[1].start_s is None


@pytest.mark.parametrize("patch,line,pattern", [
    ({"prompt_tokens": 105}, 2, r"'prompt_tokens'=105 must be >= previous prompt_tokens \+ output_tokens = 110"),
    ({"turn": 2}, 2, "turn 2 follows turn 0"),
    ({"output_tokens": 0}, 2, r"'output_tokens'=0 outside \[1, inf\]"),
    ({"tool_gap_s": "soon"}, 2, "'tool_gap_s' must be float"),
    ({"prompt_tokens": 150, "prefix_tokens": 111}, 2, r"'prefix_tokens'=111 must be <= previous prompt_tokens \+ "
                                                      r"output_tokens = 110"),
    ({"prompt_tokens": 105, "prefix_tokens": 106}, 2, r"'prefix_tokens'=106 must be <= prompt_tokens = 105"),
    ({"prefix_tokens": -1}, 2, r"'prefix_tokens'=-1 outside \[0, inf\]"),
    ({"hints": {"calls_left": -2}}, 2, r"field 'hints': calls_left must be an integer >= 0, got -2"),
    ({"hints": {"steps": 2}}, 2, r"field 'hints': steps is not a hint \(known: calls_left, tool_s, priority\)"),
    ({"hints": 3}, 2, r"field 'hints': hints must be an object, got 3"),
])
def test_malformed_line_names_line_and_field(patch, line, pattern):
    rows = [dict(GOOD[0]), {**GOOD[1], **patch}]
    with pytest.raises(TraceError, match=rf"t.jsonl:{line}: .*{pattern}"):
        parse_jsonl(_lines(rows), "t.jsonl")


def test_prefix_tokens_allows_a_shorter_prompt():
    rows = [GOOD[0], {**GOOD[1], "prompt_tokens": 60, "prefix_tokens": 40}]
    calls = parse_jsonl(_lines(rows), "t.jsonl")
    assert calls[1].prefix_tokens == 40 and reusable_prefixes(calls[:2])[calls[1].key] == 40
    assert calls[0].prefix_tokens is None and calls[1].max_prefix_tokens == 40 and calls[0].max_prefix_tokens == 100
    assert calls.where(("s0", 1)) == "t.jsonl:2"
    with pytest.raises(TraceError, match="t:1: field 'prefix_tokens'=5 must be 0 on turn 0"):
        parse_jsonl([json.dumps({**GOOD[0], "prefix_tokens": 5})], "t")


def test_a_session_may_change_model_and_reuses_each_models_own_kv():
    """A call reuses what the session's last call on its own model left, up to the smallest prefix of
    the calls since (a compaction on either model starts a new prefix for both)."""
    rows = [GOOD[0],  # m1: 100 + 10
            {**GOOD[1], "model": "m2"},  # m2's first call: nothing of its own cached
            {**GOOD[1], "turn": 2, "prompt_tokens": 200},  # m1 again: its own 110 tokens
            {**GOOD[1], "turn": 3, "model": "m2", "prompt_tokens": 230},  # m2: its own 160
            {**GOOD[1], "turn": 4, "prompt_tokens": 150, "prefix_tokens": 120},  # m1 compacts to 120
            {**GOOD[1], "turn": 5, "model": "m2", "prompt_tokens": 400}]  # m2: its 240, cut to 120
    calls = parse_jsonl(_lines(rows), "t.jsonl")
    assert [c.model for c in calls] == ["m1", "m2", "m1", "m2", "m1", "m2"]
    assert list(reusable_prefixes(calls).values()) == [0, 0, 110, 160, 120, 120]
    assert summary(calls)["multi_model_sessions"] == 1


def test_generator_gives_sessions_a_second_model():
    one = generate(TraceSpec(sessions=20, turns=10))
    two = generate(TraceSpec(sessions=20, turns=10, second_model_share=0.3))
    assert summary(one)["multi_model_sessions"] == 0
    assert summary(two)["multi_model_sessions"] >= 15
    by = {}
    for c in two:
        by.setdefault(c.session, []).append(c.model)
    assert all(len(set(ms)) <= 2 for ms in by.values())
    assert 0.15 < sum(m != ms[0] for ms in by.values() for m in ms) / len(two) < 0.4
    with pytest.raises(TraceError, match="'second_model_share'=0.5 needs at least two models or 'second_models'"):
        TraceSpec(models=("a",), second_model_share=0.5)
    helper = generate(TraceSpec(sessions=20, turns=10, second_model_share=0.3, second_models=("small",)))
    assert {c.model for c in helper if c.turn == 0} <= set(TraceSpec().models)
    assert {c.model for c in helper} - set(TraceSpec().models) == {"small"}
    with pytest.raises(TraceError, match=r"'second_models' \['a'\] are also in 'models'"):
        TraceSpec(models=("a", "b"), second_models=("a",))
    with pytest.raises(TraceError, match=r"'second_model_share'=1.5 outside \[0.0, 1.0\]"):
        TraceSpec(second_model_share=1.5)


def test_bad_json_and_missing_fields():
    with pytest.raises(TraceError, match="t:2: not valid JSON"):
        parse_jsonl([json.dumps(GOOD[0]), "{oops"], "t")
    row = dict(GOOD[0])
    del row["start_s"]
    with pytest.raises(TraceError, match="t:1: missing field 'start_s'"):
        parse_jsonl([json.dumps(row)], "t")


def test_generator_is_deterministic_and_round_trips(tmp_path):
    spec = TraceSpec(sessions=3, turns=4, seed=7)
    a, b = generate(spec), generate(spec)
    assert a == b and a != generate(TraceSpec(sessions=3, turns=4, seed=8))
    write_jsonl(a, tmp_path / "t.jsonl")
    assert read_jsonl(tmp_path / "t.jsonl") == a


@pytest.mark.parametrize("spec", [TraceSpec(sessions=4, turns=150),  # reaches max_context_tokens: must compact
                                  TraceSpec(sessions=4, turns=60, compact_at_tokens=20000, seed=3)])
def test_compacting_traces_round_trip(tmp_path, spec):
    calls = generate(spec)
    compacted = [c for c in calls if c.prefix_tokens is not None]
    assert compacted and max(c.context_after for c in calls) <= spec.max_context_tokens
    first = {c.session: c.prompt_tokens for c in calls if c.turn == 0}
    assert all(c.prefix_tokens == first[c.session] for c in compacted)  # the kept system prompt + issue
    write_jsonl(calls, tmp_path / "t.jsonl")
    text = (tmp_path / "t.jsonl").read_text()
    assert text.count("prefix_tokens") == len(compacted)  # written only where set
    assert read_jsonl(tmp_path / "t.jsonl") == calls


def test_compaction_settings_are_checked():
    with pytest.raises(TraceError, match="'compact_at_tokens'=5000 must be 0 \\(off\\) or > .* = 8000"):
        TraceSpec(compact_at_tokens=5000)
    with pytest.raises(TraceError, match="'max_context_tokens'=4000 must be >= .* = 8048"):
        TraceSpec(max_context_tokens=4000)


def test_default_trace_matches_references():
    calls = read_jsonl(CONFIG_DIR / "traces" / "swebench-30x32.jsonl")
    s = summary(calls)
    assert s["sessions"] == 30 and s["calls"] == 960 and len(s["sessions_per_model"]) == 3
    assert 0.2 < s["tool_gap_median_s"] < 0.4 and 10 < s["tool_gap_p90_s"] < 18  # TraceLab 0.3 s / 13.6 s
    assert 180 < s["output_tokens_mean"] < 260  # ~220
    assert 0.93 < s["prefix_reuse_fraction"] < 0.99  # ~96%
    assert calls == generate(TraceSpec())  # the file is what the documented spec generates


@pytest.mark.parametrize("name, spec, median", [
    ("short-30", TraceSpec(turns=6, turns_sigma=0.5), 7),
    ("long-30", TraceSpec(turns=64, turns_sigma=0.4), 55),
    ("bimodal-30", TraceSpec(turns=3, turns_sigma=0.5, long_turns=50, long_share=0.3), 4),
])
def test_session_length_traces_are_what_their_spec_generates(name, spec, median):
    calls = read_jsonl(CONFIG_DIR / "traces" / f"{name}.jsonl")
    assert calls == generate(spec) and summary(calls)["calls_per_session"][0] == median
    with pytest.raises(TraceError, match=r"'long_turns'=0 outside \[1, 10000\]"):
        TraceSpec(long_share=0.5)


def test_talaria_trace_command(tmp_path, capsys):
    from talaria_jax.launch import trace as cli

    out = tmp_path / "sub" / "t.jsonl"
    assert cli.main(["talaria-trace", "--sessions=3", "--turns=60", "--models=glm-4.5-air,gpt-oss-120b",
                     "--arrival_rate=1.0", "--seed=2", "--compact_at_tokens=20000", "--tool_gap_scale=0.5",
                     f"--out={out}"]) == 0
    spec = TraceSpec(sessions=3, turns=60, models=("glm-4.5-air", "gpt-oss-120b"), arrival_rate_per_s=1.0, seed=2,
                     compact_at_tokens=20000, tool_gap_scale=0.5)
    calls = read_jsonl(out)
    assert calls == generate(spec) and any(c.prefix_tokens for c in calls)
    text = capsys.readouterr().out
    assert f"wrote {out}: 180 calls" in text and "| compactions (calls with prefix_tokens) |" in text
    for argv, msg in ((["--sessions=0"], "--sessions=0 must be >= 1"),
                      (["--models=gpt-5"], "--models: 'gpt-5' is neither a variant"),
                      (["--compact_at_tokens=5000"], "'compact_at_tokens'=5000 must be 0 (off) or >"),
                      (["--turns=x"], "flag --turns=x: invalid literal")):
        with pytest.raises(SystemExit) as e:
            cli.main(["talaria-trace", f"--out={out}", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("talaria-trace: error: ") and msg in err and err.count("\n") == 1


def test_hints_round_trip_and_the_replay_modes(tmp_path):
    calls = generate(TraceSpec(sessions=3, turns=4, seed=1))
    true = with_hints(calls, "true")
    assert [c.hints.calls_left for c in true[:4]] == [3, 2, 1, 0]
    assert all(c.hints.tool_s == c.tool_gap_s for c in true)
    write_jsonl(true, tmp_path / "h.jsonl")
    assert read_jsonl(tmp_path / "h.jsonl") == true  # hints travel in the trace file
    assert with_hints(true, "trace") == true and not any(c.hints for c in with_hints(true, "none"))
    wrong = with_hints(calls, "wrong", seed=0)
    assert [c.hints.calls_left for c in wrong[:4]] == [0, 1, 2, 3]  # counted from the wrong end
    assert sorted(c.hints.tool_s for c in wrong) == sorted(c.tool_gap_s for c in calls)
    assert [c.hints.tool_s for c in wrong] != [c.tool_gap_s for c in calls]
    prio = [c if c.turn else dataclasses.replace(c, hints=Hints(priority=2)) for c in calls]
    assert with_hints(prio, "none")[0].hints == Hints(priority=2)  # priorities stay: they are not predictions
    with pytest.raises(ValueError, match="hints mode 'some' not in trace|none|true|wrong"):
        with_hints(calls, "some")
