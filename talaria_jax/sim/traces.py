"""SWE-bench-style agent session traces: a generator and the JSONL format (docs/traces.md).

One call per line: {"session", "turn", "model", "prompt_tokens", "output_tokens", "tool_gap_s"}
plus "start_s" on turn 0, on a turn that compacts its context "prefix_tokens", and where the agent
told the server something of its session "hints" ({"calls_left", "tool_s", "priority"}, any of them:
``Hints``; `with_hints` derives them from the trace). Unknown fields are ignored; a malformed line
raises ``TraceError`` with its line number. Statistics of the generator follow docs/references.md
("Agent sessions").
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Iterable, Sequence

import numpy as np

from talaria_jax.scheduler.session import NO_HINTS, Call, Hints, reusable_prefixes

# docs/references.md "Agent sessions" (TraceLab, 357K steps): tool gap median 0.3 s, p90 13.6 s, p99 3.6 min.
TOOL_GAP_MEDIAN_S = 0.3
TOOL_GAP_P90_S = 13.6
TOOL_GAP_P99_S = 216.0
_Z90 = 1.2815515655446004  # standard normal quantile at 0.9


class TraceError(ValueError):
    """A trace file or generator setting is malformed; names the line/field and the limit."""


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    """Generator settings; defaults give the default trace configs/traces/swebench-30x32.jsonl."""

    sessions: int = 30
    turns: int = 32  # calls per session (the paper: 960 calls over 30 sessions); the median with turns_sigma
    # Session lengths: lognormal around `turns` with this sigma (0: every session makes `turns` calls),
    # and a share `long_share` of sessions around `long_turns` instead (a bimodal mix of quick lookups
    # and long coding sessions), each clipped to [1, max_turns].
    turns_sigma: float = 0.0
    long_turns: int = 0
    long_share: float = 0.0
    max_turns: int = 1000
    models: tuple[str, ...] = ("qwen3-235b-a22b", "glm-4.5-fp8", "llama-3.1-405b-fp8")
    zipf_s: float = 1.0  # popularity of model rank r is proportional to r^-s
    # Sessions that use two models (a planner and a helper, as coding agents mix a large model with a
    # small one for subagents, summaries or quick edits; docs/references.md "Agent sessions"): each
    # session draws a second model, from `second_models` (uniformly) when given, else among the other
    # models by the same popularity, and each call after its first runs on it with this probability.
    second_model_share: float = 0.0
    second_models: tuple[str, ...] = ()
    arrival_rate_per_s: float = 0.5  # Poisson session arrivals: a batch of SWE-bench tasks launched together
    system_tokens: tuple[int, int] = (2000, 6000)  # system prompt + issue, uniform (docs/references.md: 2-6K)
    obs_median_tokens: float = 500.0  # tool observation per turn, lognormal (docs/references.md: median 0.5-1K, tail 8K+)
    obs_sigma: float = 1.0  # p99 = 500 * e^2.33 = 5.1K; the clip below cuts the 8K+ tail at 16K
    obs_max_tokens: int = 16000
    output_mean_tokens: float = 220.0  # docs/references.md: ~220 output tokens per call (OpenHands/SWE-smith)
    output_sigma: float = 0.6
    output_range: tuple[int, int] = (16, 2048)
    max_context_tokens: int = 131072  # docs/references.md: deepest turn up to 131K; a turn that would pass it compacts
    # Context compaction (0 = off): a turn whose prompt would exceed compact_at_tokens instead starts a
    # new prefix: it keeps the session's first prompt (system prompt + issue, drawn from system_tokens)
    # as its reusable prefix (prefix_tokens) and replaces the rest by a summary of compact_summary_tokens
    # new tokens. A turn whose prompt + output would pass max_context_tokens compacts the same way,
    # whatever compact_at_tokens is (its summary shortened if it must be, to fit).
    compact_at_tokens: int = 0
    compact_summary_tokens: int = 2000
    gap_median_s: float = TOOL_GAP_MEDIAN_S
    gap_p90_s: float = TOOL_GAP_P90_S
    gap_max_s: float = TOOL_GAP_P99_S  # clip at the reported p99 so one session is not a single 20-minute tool run
    tool_gap_scale: float = 1.0  # multiplies every drawn tool gap (the draws stay the same)
    seed: int = 0

    def __post_init__(self):
        checks = [("sessions", self.sessions, 1, 1_000_000), ("turns", self.turns, 1, 10_000),
                  ("turns_sigma", self.turns_sigma, 0.0, 5.0), ("long_share", self.long_share, 0.0, 1.0),
                  ("long_turns", self.long_turns, 1 if self.long_share else 0, 10_000),
                  ("max_turns", self.max_turns, 1, 10_000),
                  ("zipf_s", self.zipf_s, 0.0, 10.0),
                  ("second_model_share", self.second_model_share, 0.0, 1.0), ("arrival_rate_per_s", self.arrival_rate_per_s, 1e-9, 1e9),
                  ("obs_median_tokens", self.obs_median_tokens, 1, 1e6), ("output_mean_tokens", self.output_mean_tokens, 1, 1e6),
                  ("gap_median_s", self.gap_median_s, 1e-6, 1e6), ("gap_p90_s", self.gap_p90_s, self.gap_median_s, 1e6),
                  ("tool_gap_scale", self.tool_gap_scale, 0.0, 1e6), ("compact_at_tokens", self.compact_at_tokens, 0, 1e9),
                  ("compact_summary_tokens", self.compact_summary_tokens, 1, 1e7)]
        for name, v, lo, hi in checks:
            if not lo <= v <= hi:
                raise TraceError(f"trace spec: '{name}'={v} outside [{lo}, {hi}]")
        if not self.models:
            raise TraceError("trace spec: 'models' must name at least one model")
        if self.second_model_share and not self.second_models and len(set(self.models)) < 2:
            raise TraceError(f"trace spec: 'second_model_share'={self.second_model_share} needs at least two "
                             f"models or 'second_models', got models {list(self.models)}")
        if set(self.second_models) & set(self.models):
            raise TraceError(f"trace spec: 'second_models' {sorted(set(self.second_models) & set(self.models))} are "
                             f"also in 'models' (a session's second model differs from its first)")
        if self.system_tokens[1] + self.output_range[1] > self.max_context_tokens:
            raise TraceError(f"trace spec: 'max_context_tokens'={self.max_context_tokens} must be >= system_tokens max "
                             f"+ output_range max = {self.system_tokens[1] + self.output_range[1]} (a compacted turn "
                             f"must fit)")
        compacted = self.system_tokens[1] + self.compact_summary_tokens  # the longest prompt after a compaction
        if self.compact_at_tokens and not compacted < self.compact_at_tokens:
            raise TraceError(f"trace spec: 'compact_at_tokens'={self.compact_at_tokens} must be 0 (off) or > system_tokens "
                             f"max + compact_summary_tokens = {compacted} (a compaction must shrink the context)")


def generate(spec: TraceSpec) -> list[Call]:
    """Draws sessions per `spec`; the same spec (seed included) gives the same calls."""
    rng = np.random.default_rng(spec.seed)
    ranks = np.arange(1, len(spec.models) + 1, dtype=float)
    pop = ranks ** -spec.zipf_s
    pop /= pop.sum()
    gap_sigma = math.log(spec.gap_p90_s / spec.gap_median_s) / _Z90
    out_mu = math.log(spec.output_mean_tokens) - spec.output_sigma**2 / 2  # lognormal with the given mean
    calls: list[Call] = []
    t = 0.0
    width = max(2, len(str(spec.sessions - 1)))
    for s in range(spec.sessions):
        t += float(rng.exponential(1.0 / spec.arrival_rate_per_s)) if s else 0.0
        first = int(rng.choice(len(spec.models), p=pop))
        model = second = spec.models[first]
        if spec.second_model_share and spec.second_models:  # (no draw without a share: traces stay as they were)
            second = spec.second_models[int(rng.integers(len(spec.second_models)))]
        elif spec.second_model_share:
            others = np.array([m != model for m in spec.models], dtype=float) * pop
            second = spec.models[int(rng.choice(len(spec.models), p=others / others.sum()))]
        system = prompt = int(rng.integers(spec.system_tokens[0], spec.system_tokens[1] + 1))
        sid = f"s{s:0{width}d}"
        turns = _turns(spec, rng)
        for k in range(turns):
            on = second if k and spec.second_model_share and rng.random() < spec.second_model_share else model
            out = int(np.clip(rng.lognormal(out_mu, spec.output_sigma), *spec.output_range))
            last = k == turns - 1
            gap = 0.0 if last else float(min(spec.gap_max_s, rng.lognormal(math.log(spec.gap_median_s), gap_sigma)))
            gap *= spec.tool_gap_scale
            prefix = None
            if prompt + out > spec.max_context_tokens or 0 < spec.compact_at_tokens < prompt:
                # compaction: a new prefix, the first prompt, then the summary
                prompt, prefix = min(system + spec.compact_summary_tokens, spec.max_context_tokens - out), system
            calls.append(Call(sid, k, on, prompt, out, round(gap, 3), round(t, 3) if k == 0 else None, prefix))
            obs = int(min(spec.obs_max_tokens, rng.lognormal(math.log(spec.obs_median_tokens), spec.obs_sigma)))
            prompt = prompt + out + obs
    return calls


def _turns(spec: TraceSpec, rng: np.random.Generator) -> int:
    """One session's calls (no draw at all for fixed lengths, so such traces stay as they were)."""
    if not spec.turns_sigma and not spec.long_share:
        return spec.turns
    median = spec.long_turns if spec.long_share and rng.random() < spec.long_share else spec.turns
    n = median * math.exp(spec.turns_sigma * rng.standard_normal()) if spec.turns_sigma else median
    return int(min(spec.max_turns, max(1, round(n))))


def write_jsonl(calls: Iterable[Call], path: str | pathlib.Path) -> None:
    with open(path, "w") as f:
        for c in calls:
            d = {"session": c.session, "turn": c.turn, "model": c.model, "prompt_tokens": c.prompt_tokens,
                 "output_tokens": c.output_tokens, "tool_gap_s": c.tool_gap_s}
            if c.turn == 0:
                d["start_s"] = c.start_s
            if c.prefix_tokens is not None:
                d["prefix_tokens"] = c.prefix_tokens
            if c.hints:
                d["hints"] = c.hints.as_dict()
            f.write(json.dumps(d) + "\n")


def _field(d: dict, name: str, kind: type, where: str, lo: float, hi: float | None = None):
    if name not in d:
        raise TraceError(f"{where}: missing field '{name}'")
    v = d[name]
    ok = isinstance(v, str) if kind is str else (isinstance(v, (int, float)) and not isinstance(v, bool))
    if kind is int and ok and float(v) != int(v):
        ok = False
    if not ok:
        raise TraceError(f"{where}: field '{name}' must be {kind.__name__}, got {v!r}")
    if kind is str:
        if not v:
            raise TraceError(f"{where}: field '{name}' must be a non-empty string")
        return v
    if not math.isfinite(v) or v < lo or (hi is not None and v > hi):
        raise TraceError(f"{where}: field '{name}'={v} outside [{lo}, {hi if hi is not None else 'inf'}]")
    return kind(v)


class Trace(list):
    """The calls of a trace file in file order (a list of ``Call``), and where each was read:
    ``where(key)`` is "file:line", for checks made after parsing (unknown model, too big a call)."""

    def __init__(self, calls: Iterable[Call], source: str, lines: dict[tuple[str, int], int] | None = None):
        super().__init__(calls)
        self.source, self.lines = source, lines or {}

    def where(self, key: tuple[str, int]) -> str:
        line = self.lines.get(key)
        return f"{self.source}:{line}" if line is not None else f"{self.source}: call {key}"


def parse_jsonl(lines: Iterable[str], source: str = "<trace>") -> Trace:
    """Parses and validates a trace; errors name the line, the field and the limit."""
    calls: list[Call] = []
    lines_of: dict[tuple[str, int], int] = {}  # call key -> line
    last: dict[str, Call] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise TraceError(f"{where}: a line must be a JSON object")
        sid = _field(d, "session", str, where, 0)
        turn = _field(d, "turn", int, where, 0)
        model = _field(d, "model", str, where, 0)
        prompt = _field(d, "prompt_tokens", int, where, 1)
        out = _field(d, "output_tokens", int, where, 1)
        gap = _field(d, "tool_gap_s", float, where, 0.0)
        start = _field(d, "start_s", float, where, 0.0) if turn == 0 else None
        prefix = _field(d, "prefix_tokens", int, where, 0) if "prefix_tokens" in d else None
        hints = _hints(d["hints"], where) if "hints" in d else NO_HINTS
        prev = last.get(sid)
        if prev is None and turn != 0:
            raise TraceError(f"{where}: session {sid!r} starts at turn {turn}; its first line must be turn 0")
        if prev is not None:
            if turn != prev.turn + 1:
                raise TraceError(f"{where}: session {sid!r} turn {turn} follows turn {prev.turn} "
                                 f"(line {lines_of[prev.key]}); turns must be consecutive")
            if prefix is None and prompt < prev.context_after:
                raise TraceError(f"{where}: field 'prompt_tokens'={prompt} must be >= previous prompt_tokens + "
                                 f"output_tokens = {prev.context_after} (the earlier context is the prefix; a turn "
                                 f"that compacts its context states 'prefix_tokens')")
        if prefix is not None:
            if prefix > prompt:
                raise TraceError(f"{where}: field 'prefix_tokens'={prefix} must be <= prompt_tokens = {prompt}")
            if prev is None and prefix > 0:
                raise TraceError(f"{where}: field 'prefix_tokens'={prefix} must be 0 on turn 0 (no earlier context)")
            if prev is not None and prefix > prev.context_after:
                raise TraceError(f"{where}: field 'prefix_tokens'={prefix} must be <= previous prompt_tokens + "
                                 f"output_tokens = {prev.context_after} (the session's earlier context)")
        c = Call(sid, turn, model, prompt, out, gap, start, prefix, hints)
        calls.append(c)
        last[sid], lines_of[c.key] = c, n
    if not calls:
        raise TraceError(f"{source}: no calls")
    return Trace(calls, source, lines_of)


def _hints(d, where: str) -> Hints:
    try:
        return Hints.from_json(d)
    except ValueError as e:
        raise TraceError(f"{where}: field 'hints': {e}") from None


HINT_MODES = ("trace", "none", "ends", "true", "wrong")


def with_hints(calls: Sequence[Call], mode: str, seed: int = 0) -> list[Call]:
    """The calls with the hints an agent would send. trace: as the trace has them; none: none;
    ends: only a session's last call says so (calls_left 0), as an agent that knows when its task is
    done would; true: each call's calls_left and tool_s from the trace itself (what the agent will do);
    wrong: an agent wrong about everything: its calls counted from the wrong end (calls_left of turn
    k is k, so its first call says it ends the session and its last says it has as many to go) and
    the tool time of another call (the trace's gaps shuffled, drawn from `seed`). Priorities are
    left as they are."""
    if mode not in HINT_MODES:
        raise ValueError(f"hints mode {mode!r} not in {'|'.join(HINT_MODES)}")
    if mode == "trace":
        return list(calls)
    if mode == "none":
        return [dataclasses.replace(c, hints=Hints(priority=c.hints.priority)) for c in calls]
    length: dict[str, int] = {}
    for c in calls:
        length[c.session] = max(length.get(c.session, 0), c.turn + 1)
    if mode == "ends":
        return [dataclasses.replace(c, hints=Hints(0 if c.turn == length[c.session] - 1 else None,
                                                   priority=c.hints.priority)) for c in calls]
    if mode == "true":
        return [dataclasses.replace(c, hints=Hints(length[c.session] - c.turn - 1, c.tool_gap_s, c.hints.priority))
                for c in calls]
    gaps = [c.tool_gap_s for c in calls]
    shuffled = [gaps[k] for k in np.random.default_rng(seed).permutation(len(gaps))]
    return [dataclasses.replace(c, hints=Hints(c.turn, shuffled[k], c.hints.priority)) for k, c in enumerate(calls)]


def read_jsonl(path: str | pathlib.Path) -> Trace:
    p = pathlib.Path(path)
    if not p.exists():
        raise TraceError(f"trace file not found: {p}")
    with open(p) as f:
        return parse_jsonl(f, str(p))


def summary(calls: Sequence[Call]) -> dict:
    """Statistics of a trace, for docs/traces.md and for checking the generator against docs/references.md."""
    by: dict[str, list[Call]] = {}
    for c in calls:
        by.setdefault(c.session, []).append(c)
    gaps = np.array([c.tool_gap_s for cs in by.values() for c in cs[:-1]])
    deepest = np.array([max(c.context_after for c in cs) for cs in by.values()])
    reuse = sum(sum(reusable_prefixes(cs).values()) for cs in by.values())
    models: dict[str, int] = {}
    for cs in by.values():
        models[cs[0].model] = models.get(cs[0].model, 0) + 1
    several = sum(len({c.model for c in cs}) > 1 for cs in by.values())
    return {
        "sessions": len(by), "calls": len(calls), "sessions_per_model": models,
        "multi_model_sessions": several,
        "calls_per_session": [int(np.median([len(cs) for cs in by.values()])),
                              int(np.quantile([len(cs) for cs in by.values()], 0.9)), max(len(cs) for cs in by.values())],
        "output_tokens_mean": float(np.mean([c.output_tokens for c in calls])),
        "tool_gap_median_s": float(np.median(gaps)) if gaps.size else 0.0,
        "tool_gap_p90_s": float(np.quantile(gaps, 0.9)) if gaps.size else 0.0,
        "tool_gap_mean_s": float(gaps.mean()) if gaps.size else 0.0,
        "deepest_context_mean": float(deepest.mean()), "deepest_context_max": int(deepest.max()),
        "prefix_reuse_fraction": reuse / sum(c.prompt_tokens for c in calls),
        "compactions": sum(1 for c in calls if c.prefix_tokens is not None),
        "last_start_s": max(c.start_s for c in calls if c.turn == 0),
    }
