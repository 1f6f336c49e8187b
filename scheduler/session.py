"""Agent sessions and their LLM calls, as the scheduler tracks them."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Call:
    """One LLM call of a session. prompt_tokens includes the whole earlier context (the prefix)."""

    session: str
    turn: int
    model: str
    prompt_tokens: int
    output_tokens: int
    tool_gap_s: float  # time the agent's tool runs after this call completes, before the next call
    start_s: float | None = None  # session arrival, on turn 0 only

    @property
    def key(self) -> tuple[str, int]:
        return (self.session, self.turn)

    @property
    def is_continuation(self) -> bool:
        return self.turn > 0

    @property
    def context_after(self) -> int:
        """KV tokens the session holds once this call has finished."""
        return self.prompt_tokens + self.output_tokens


@dataclasses.dataclass
class Session:
    """A session's calls in turn order, and where its last call ran."""

    id: str
    calls: list[Call]
    next_turn: int = 0
    last_instance: str | None = None
    arrived_s: float | None = None
    finished_s: float | None = None

    @property
    def model(self) -> str:
        return self.calls[0].model

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
        s.last_instance = instance
        if s.done:
            s.finished_s = now
        return s.next_call()
