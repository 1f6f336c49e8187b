"""Agent sessions and their LLM calls, as the scheduler tracks them."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


MAX_PRIORITY = 8


@dataclasses.dataclass(frozen=True)
class Hints:
    """What an agent may tell the scheduler about one call's session (all optional; docs/serving.md
    "Agent hints"). Without a hint the scheduler estimates the same thing from what it observes.

    calls_left: the calls the session makes after this one (0: this call ends it, so its KV is freed
    as soon as it finishes and nothing is reserved for a return). tool_s: the seconds the agent's
    tool is expected to run after this call before the next one (reservations and slot holds follow
    it). priority: an integer in [-MAX_PRIORITY, MAX_PRIORITY], higher first; a session counts
    2**priority times in the slot order (weighted Smith's rule) and its calls are admitted first
    among its model's. Raises ValueError naming the field and its limit."""

    calls_left: int | None = None
    tool_s: float | None = None
    priority: int = 0

    def __post_init__(self):
        if self.calls_left is not None and (type(self.calls_left) is not int or self.calls_left < 0):
            raise ValueError(f"calls_left must be an integer >= 0, got {self.calls_left!r}")
        if self.tool_s is not None and (isinstance(self.tool_s, bool) or not isinstance(self.tool_s, (int, float))
                                        or not 0 <= self.tool_s < float("inf")):
            raise ValueError(f"tool_s must be a finite number of seconds >= 0, got {self.tool_s!r}")
        if type(self.priority) is not int or not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")

    def __bool__(self) -> bool:
        return self != NO_HINTS

    @classmethod
    def from_json(cls, given) -> "Hints":
        """Hints from a JSON object (a request's `agent_hints`, a trace line's `hints`): integers may
        be written as floats with no fraction, null is absent. Raises ValueError whose message starts
        with the bad field's name, then its limit."""
        if not isinstance(given, dict):
            raise ValueError(f"hints must be an object, got {given!r}"[:300])
        known = [f.name for f in dataclasses.fields(cls)]
        kw = {}
        for name, v in given.items():
            if name not in known:
                raise ValueError(f"{name} is not a hint (known: {', '.join(known)})"[:300])
            if v is not None:
                kw[name] = int(v) if name != "tool_s" and isinstance(v, float) and v.is_integer() else v
        return cls(**kw)

    def as_dict(self) -> dict:
        """The hints given, as the JSON object of a request or a trace line (no None fields)."""
        d = {"calls_left": self.calls_left, "tool_s": self.tool_s, "priority": self.priority or None}
        return {k: v for k, v in d.items() if v is not None}


NO_HINTS = Hints()


@dataclasses.dataclass(frozen=True)
class Call:
    """One LLM call of a session. prompt_tokens includes the whole earlier context (the prefix),
    unless prefix_tokens says how much of it is kept: an agent that compacts or truncates its
    context starts a new prefix, and only the first prefix_tokens of the prompt are KV that the
    session's earlier calls computed (None: the whole earlier context is the prefix)."""

    session: str
    turn: int
    model: str
    prompt_tokens: int
    output_tokens: int
    tool_gap_s: float  # time the agent's tool runs after this call completes, before the next call
    start_s: float | None = None  # session arrival, on turn 0 only
    prefix_tokens: int | None = None  # reusable prefix when the context was compacted; None: all of it
    hints: Hints = NO_HINTS  # what the agent said about this call's session (Hints)
    request_id: str | None = None  # the live request it serves (its one id, from the server's front door)

    @property
    def key(self) -> tuple[str, int]:
        return (self.session, self.turn)

    @property
    def id(self) -> str:
        """The engine's request id of the call: its live request's id, else (a replayed trace's call)
        `session/turn`."""
        return self.request_id if self.request_id is not None else f"{self.session}/{self.turn}"

    @property
    def is_continuation(self) -> bool:
        return self.turn > 0

    @property
    def max_prefix_tokens(self) -> int:
        """Most tokens of the prompt that KV cached by the session's earlier calls may supply:
        prefix_tokens when stated, else the whole prompt (cached KV beyond it is stale)."""
        return self.prompt_tokens if self.prefix_tokens is None else self.prefix_tokens

    @property
    def context_after(self) -> int:
        """KV tokens the session holds once this call has finished."""
        return self.prompt_tokens + self.output_tokens


def reusable_prefixes(calls: Sequence[Call]) -> dict[tuple[str, int], int]:
    """Each call's reusable prefix (`Call.key` -> tokens), from one session's calls in turn order: KV is
    per model, so a call reuses what its session's previous call *on the same model* left (its
    `context_after`), up to the smallest ``max_prefix_tokens`` of the calls since then (a compaction
    on any model starts a new prefix for all of them). 0 for a model's first call in the session."""
    out: dict[tuple[str, int], int] = {}
    held: dict[str, int] = {}  # model -> the KV tokens of the session's context still valid for it
    for c in calls:
        out[c.key] = min(held.get(c.model, 0), c.max_prefix_tokens)
        held = {m: min(t, c.max_prefix_tokens) for m, t in held.items()}
        held[c.model] = c.context_after
    return out


@dataclasses.dataclass
class Session:
    """A session's calls in turn order, and where its last call ran. A session's calls may name
    different models; `model` is the one its next call is expected on."""

    id: str
    calls: list[Call]
    next_turn: int = 0
    last_instance: str | None = None
    arrived_s: float | None = None
    finished_s: float | None = None
    single: bool = False  # a call sent without a session: not an agent session
    last_model: str | None = None  # the model of its last finished call

    @property
    def model(self) -> str:
        """The model its next call is expected on: its last finished call's (its first call's before
        any finished). A scheduler never reads a future call's model from a replayed trace."""
        return self.last_model if self.last_model is not None else self.calls[0].model

    @property
    def done(self) -> bool:
        return self.next_turn >= len(self.calls)

    def next_call(self) -> Call | None:
        return None if self.done else self.calls[self.next_turn]


class SessionTable:
    """All sessions of a replay, keyed by id; checks that calls complete once and in order."""

    def __init__(self, calls: list[Call]):
        by: dict[str, list[Call]] = {}
        for c in calls:
            by.setdefault(c.session, []).append(c)
        self.sessions = {sid: Session(sid, sorted(cs, key=lambda c: c.turn)) for sid, cs in by.items()}

    def __getitem__(self, sid: str) -> Session:
        return self.sessions[sid]

    def __iter__(self):
        return iter(self.sessions.values())

    def __len__(self) -> int:
        return len(self.sessions)

    def complete(self, call: Call, instance: str, now: float) -> Call | None:
        """Marks `call` done; returns the session's next call (None when the session ends)."""
        s = self.sessions[call.session]
        if call.turn != s.next_turn:
            raise AssertionError(f"call {call.key} completed out of order (expected turn {s.next_turn})")
        s.next_turn += 1
        s.last_instance, s.last_model = instance, call.model
        if s.done:
            s.finished_s = now
        return s.next_call()
