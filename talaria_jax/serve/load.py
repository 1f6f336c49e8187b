"""Scripted agent sessions against any OpenAI-compatible endpoint, measured from the client side.

The simulator (`talaria_jax.sim.traces`) replays token counts; this drives a real server with real
text, as a coding agent would: each session opens with a task, then alternates a model call and a
"tool" run (a sleep of its tool gap) whose output -- a file listing, a file, test output, a diff -- is
the next call's observation. Every call sends the whole conversation so far (chat: a growing
`messages` list; completions: a growing text prompt), so a server with a prefix cache reuses the
earlier context, and every call names its session in the `x-session-id` header (with `named=False`
none does, as most agents send them: the server infers the sessions).

`agent_sessions` scripts sessions (deterministic from a seed), `run_sessions` runs them concurrently
with the real `openai` client, one thread per session, streaming every call to time it: TTFT (send to
the first text), ITL (gaps between later text chunks), end-to-end latency and session completion time
(SCT: the first call's send to the last call's end, tool gaps included). `summarize` gives percentiles.
A failed call ends its session and is recorded, never raised.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
from tqdm import tqdm

__all__ = ["AgentSession", "CallStats", "SessionResult", "agent_sessions", "run_sessions", "summarize"]

# Lognormal jitter of a tool gap around its median: a short tail, so a test stays short (sim.traces has the real one).
TOOL_GAP_SIGMA = 0.5

_REPOS = ("astropy", "django", "flask", "requests", "sympy", "pytest", "sphinx", "xarray")
_NAMES = ("config", "parser", "utils", "models", "cache", "client", "session", "io", "fields", "core")
_FUNCS = ("parse_header", "load_config", "resolve_path", "merge_dicts", "encode_value", "validate", "to_json",
          "read_chunk", "normalize", "get_field")
_PROBLEMS = ("raises KeyError on a missing key instead of returning the default",
             "returns None for an empty input", "crashes on unicode names", "ignores the default argument")


@dataclasses.dataclass(frozen=True)
class AgentSession:
    """One scripted agent session: its calls' observations and the tool gaps between them."""
    id: str
    model: str
    chat: bool  # True: /v1/chat/completions with a growing messages list; False: /v1/completions with a growing prompt
    system: str  # the system prompt (chat) or the prompt's first text (completions)
    observations: tuple[str, ...]  # the user/tool message of each call, in order (one per call)
    max_tokens: int
    tool_gap_s: tuple[float, ...]  # seconds the tool runs after each call before the next (the last one: 0)


def agent_sessions(n: int, calls: int, models: Sequence[str], *, chat_models: Collection[str] = (), seed: int = 0,
                   max_tokens: int = 24, obs_words: tuple[int, int] = (20, 80), tool_gap_s: float = 0.3,
                   start_task: str | None = None) -> list[AgentSession]:
    """`n` sessions `s0, s1, ...` of `calls` calls each; the same arguments give the same sessions.

    Models are drawn Zipf-like (rank r has weight 1/r: the first model is the most popular, as in
    `sim.traces`); a session uses chat iff its model is in `chat_models`. The first observation is a
    coding task (`start_task` when given, for every session), later ones tool output; each generated
    observation has a word count drawn uniformly from `obs_words` (inclusive). Tool gaps are
    lognormal around the median `tool_gap_s`.
    """
    lo, hi = obs_words
    if n < 0 or calls < 1 or not models or not 1 <= lo <= hi or max_tokens < 1 or tool_gap_s < 0:
        raise ValueError(f"agent_sessions: need n >= 0, calls >= 1, a model, 1 <= obs_words[0] <= obs_words[1], "
                         f"max_tokens >= 1 and tool_gap_s >= 0 (got n={n}, calls={calls}, models={list(models)}, "
                         f"obs_words={obs_words}, max_tokens={max_tokens}, tool_gap_s={tool_gap_s})")
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, len(models) + 1)
    pop /= pop.sum()
    out = []
    for s in range(n):
        model = models[int(rng.choice(len(models), p=pop))]
        repo = str(rng.choice(_REPOS))
        system = (f"You are a coding agent working in the {repo} repository. Use tools to inspect files, run "
                  f"tests and edit code. Answer with the next tool call.")
        obs = [start_task if start_task is not None else _observation(rng, 0, repo, lo, hi)]
        obs += [_observation(rng, 1 + int(rng.integers(4)), repo, lo, hi) for _ in range(calls - 1)]
        gaps = [round(float(tool_gap_s * rng.lognormal(0.0, TOOL_GAP_SIGMA)), 3) for _ in range(calls - 1)] + [0.0]
        out.append(AgentSession(f"s{s}", model, model in chat_models, system, tuple(obs), max_tokens, tuple(gaps)))
    return out


def _observation(rng: np.random.Generator, kind: int, repo: str, lo: int, hi: int) -> str:
    """Text of `kind` (0 a task, 1 a file listing, 2 a file, 3 test output, 4 a diff) cut to a word
    count drawn from [lo, hi] (`len(text.split())`); whole lines are kept but the last."""
    def pick(xs) -> str:
        return str(rng.choice(xs))

    path, func = f"{repo}/{pick(_NAMES)}.py", pick(_FUNCS)
    head = (f"Task: in {path}, {func}() {pick(_PROBLEMS)}. Make the failing test pass without breaking the others.",
            f"$ ls {repo}/", f"$ cat {path}", f"$ pytest -q tests/test_{pick(_NAMES)}.py", "$ git diff")[kind]

    def block() -> str:
        f, n = pick(_FUNCS), int(rng.integers(1, 400))
        return (f'  File "{path}", line {n}, in {f}\n    return {pick(_FUNCS)}(value)',
                f"{pick(_NAMES)}{pick(('.py', '/', '_test.py', '.cfg'))}",
                f"def {f}(value, default=None):\n    if value is None:\n        raise KeyError({pick(_NAMES)!r})\n"
                f"    return {pick(_FUNCS)}(value)\n",
                f"tests/test_{pick(_NAMES)}.py::test_{f} " + pick(("PASSED", f"FAILED - AssertionError: {n} != 0")),
                f"--- a/{path}\n+++ b/{path}\n@@ -{n},6 +{n},7 @@ def {func}(value, default=None):\n"
                f"-    return {f}(value)\n+    return {f}(value, default)")[kind]

    want = int(rng.integers(lo, hi + 1))
    text, words = [head], len(head.split())
    while words < want:
        text.append(block())
        words += len(text[-1].split())
    lines, room = [], want
    for line in "\n".join(text).splitlines():
        ws = line.split()
        lines.append(line if len(ws) <= room else line[:len(line) - len(line.lstrip())] + " ".join(ws[:room]))
        room -= min(room, len(ws))
        if not room:
            break
    return "\n".join(lines)


@dataclasses.dataclass
class CallStats:
    """One call as the client saw it. `ttft_s` is NaN when no text came; token counts come from the
    stream's usage chunk (0 when the server sends none)."""
    session: str
    turn: int
    ttft_s: float
    itl_s: list[float]
    e2e_s: float
    completion_tokens: int
    cached_tokens: int
    text: str
    error: str | None = None


@dataclasses.dataclass
class SessionResult:
    """A session's calls (up to and including a failed one) and its completion time."""
    id: str
    model: str
    sct_s: float
    calls: list[CallStats]

    @property
    def errors(self) -> list[str]:
        return [c.error for c in self.calls if c.error is not None]


def run_sessions(base_url: str, api_key: str, sessions: Sequence[AgentSession], *, start_gap_s: float = 0.0,
                 progress: bool | None = None, timeout_s: float = 300.0,
                 seed: int | None = None, named: bool = True) -> list[SessionResult]:
    """Runs `sessions` concurrently against the server at `base_url` (without `/v1`), session k
    starting `k * start_gap_s` after the first; results in the order of `sessions`.

    Calls are greedy (temperature 0) unless `seed` is given: then it is sent with every call and the
    server samples at its default temperature. `progress` shows a bar over calls on stderr (None: when
    stderr is a terminal). `named`: every call names its session (`x-session-id`); False: none does.
    Never raises for a failed call: see `SessionResult.errors`.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    sampling = {"temperature": 0.0} if seed is None else {"seed": seed}
    named_by = (lambda s: {"x-session-id": s.id}) if named else (lambda s: {})
    t0 = time.perf_counter()
    with tqdm(total=sum(len(s.observations) for s in sessions), disable=not progress, file=sys.stderr,
              unit="call") as bar, ThreadPoolExecutor(max_workers=max(1, len(sessions))) as pool:
        futures = [pool.submit(_run_session, base_url, api_key, s, t0 + k * start_gap_s, timeout_s,
                               {**sampling, "extra_headers": named_by(s)}, bar.update) for k, s in enumerate(sessions)]
        return [f.result() for f in futures]


def _run_session(base_url: str, api_key: str, s: AgentSession, start: float, timeout_s: float, sampling: dict,
                 done: Callable[[int], object]) -> SessionResult:
    """Runs one session's calls in order, sleeping its tool gaps; stops at the first failed call."""
    time.sleep(max(0.0, start - time.perf_counter()))
    calls: list[CallStats] = []
    messages = [{"role": "system", "content": s.system}]
    prompt = s.system + "\n"
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s) as client:
        first = end = time.perf_counter()
        for turn, obs in enumerate(s.observations):
            if turn:
                time.sleep(s.tool_gap_s[turn - 1])  # the tool runs on the previous call's answer
            if s.chat:
                messages.append({"role": "user", "content": obs})
            else:
                prompt += obs
            calls.append(_call(client, s, turn, messages if s.chat else prompt, sampling))
            end = time.perf_counter()
            done(1)
            if calls[-1].error is not None:
                break
            if s.chat:
                messages.append({"role": "assistant", "content": calls[-1].text})
            else:
                prompt += calls[-1].text + "\n"
    return SessionResult(s.id, s.model, end - first, calls)


def _call(client: openai.OpenAI, s: AgentSession, turn: int, context: list[dict] | str, sampling: dict) -> CallStats:
    """One streamed call, timed at each chunk that carries text."""
    kwargs = dict(model=s.model, max_tokens=s.max_tokens, stream=True, stream_options={"include_usage": True},
                  **sampling)
    texts: list[str] = []
    itl: list[float] = []
    ttft, last, usage = math.nan, 0.0, None
    sent = time.perf_counter()
    try:
        create = client.chat.completions.create if s.chat else client.completions.create
        with create(**{"messages" if s.chat else "prompt": context}, **kwargs) as stream:
            for chunk in stream:
                usage = chunk.usage or usage
                if not chunk.choices:
                    continue
                text = (chunk.choices[0].delta.content if s.chat else chunk.choices[0].text) or ""
                if not text:
                    continue
                now = time.perf_counter()
                if texts:
                    itl.append(now - last)
                else:
                    ttft = now - sent
                texts.append(text)
                last = now
    except (openai.APIError, httpx.HTTPError) as e:
        message = " ".join(str(e).split())[:500]
        return CallStats(s.id, turn, ttft, itl, time.perf_counter() - sent, 0, 0, "".join(texts),
                         f"{type(e).__name__}: {message}")
    e2e = time.perf_counter() - sent
    details = getattr(usage, "prompt_tokens_details", None)
    return CallStats(s.id, turn, ttft, itl, e2e, usage.completion_tokens if usage else 0,
                     (details.cached_tokens or 0) if details else 0, "".join(texts))


def summarize(results: Sequence[SessionResult]) -> dict:
    """Counts and p50/p90/p99 of TTFT, ITL and SCT (SCT also its mean) over successful calls and
    sessions without errors; NaN where there is no sample."""
    ok = [c for r in results for c in r.calls if c.error is None]
    ttft = [c.ttft_s for c in ok if math.isfinite(c.ttft_s)]
    itl = [g for c in ok for g in c.itl_s]
    sct = [r.sct_s for r in results if not r.errors]
    out = {"sessions": len(results), "calls": sum(len(r.calls) for r in results),
           "errors": sum(len(r.errors) for r in results)}
    for name, xs in (("ttft", ttft), ("itl", itl), ("sct", sct)):
        qs = np.quantile(xs, [0.5, 0.9, 0.99]) if xs else [math.nan] * 3
        out |= {f"{name}_p50_s": float(qs[0]), f"{name}_p90_s": float(qs[1]), f"{name}_p99_s": float(qs[2])}
    out |= {"sct_mean_s": float(np.mean(sct)) if sct else math.nan,
            "tokens": sum(c.completion_tokens for c in ok), "cached_tokens": sum(c.cached_tokens for c in ok)}
    return out
