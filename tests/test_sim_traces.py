"""The trace format and generator: validation with line numbers, determinism, the default trace."""
import json

import pytest

from talaria_jax.sim.hardware import CONFIG_ROOT
from talaria_jax.sim.traces import TraceError, TraceSpec, generate, parse_jsonl, read_jsonl, summary, write_jsonl

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
    ({"model": "m2"}, 2, "changes model"),
])
def test_malformed_line_names_line_and_field(patch, line, pattern):
    rows = [dict(GOOD[0]), {**GOOD[1], **patch}]
    with pytest.raises(TraceError, match=rf"t.jsonl:{line}: .*{pattern}"):
        parse_jsonl(_lines(rows), "t.jsonl")


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


def test_default_trace_matches_references():
    calls = read_jsonl(CONFIG_ROOT / "traces" / "swebench-30x32.jsonl")
    s = summary(calls)
    assert s["sessions"] == 30 and s["calls"] == 960 and len(s["sessions_per_model"]) == 3
    assert 0.2 < s["tool_gap_median_s"] < 0.4 and 10 < s["tool_gap_p90_s"] < 18  # TraceLab 0.3 s / 13.6 s
    assert 180 < s["output_tokens_mean"] < 260  # ~220
    assert 0.93 < s["prefix_reuse_fraction"] < 0.99  # ~96%
    assert calls == generate(TraceSpec())  # the file is what the documented spec generates
