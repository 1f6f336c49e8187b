"""What the scheduler takes from agent hints (`session.Hints`), and when it stops believing them.

A hint is a prediction: "this session makes N more calls", "the tool is back in T s". The scheduler
checks each prediction when the session's next call arrives, and uses a session's hints only once
(a) at least `min_checked` sessions have had a prediction checked, (b) at most `max_wrong` of them
have had one prove wrong (an agent framework that is wrong is wrong for all its sessions, so a new
session of it is not believed either) and (c) none of this session's predictions has proved wrong.
A prediction proves wrong when a call arrives past the last call announced (a session that said it
ended calls again), or after a tool gap longer than the hinted time with its margin; it is borne
out by a call that arrives within both, or, for a session that said it ended, by no call within the
observed p90 tool gap. Priority is a request, not a prediction: it is always taken.
"""
from __future__ import annotations

import collections

from talaria_jax.scheduler.session import Call, Hints

# A hinted tool time t is believed with this margin: the reservation and a slot hold for the
# return last SLACK * t + SLACK_S, and a gap longer than that proves the hint wrong.
SLACK, SLACK_S = 1.5, 1.0


def within_margin(tool_s: float) -> float:
    """The longest tool gap that bears out a hinted `tool_s`."""
    return SLACK * tool_s + SLACK_S


class HintBook:
    """Each session's latest hinted call, and the record of how the hints held up."""

    def __init__(self, min_checked: int = 3, max_wrong: float = 0.25, remember: int = 10_000):
        self.min_checked, self.max_wrong = min_checked, max_wrong
        self.latest: dict[str, Call] = {}  # session -> its latest call, when that call carried hints
        self.wrong_sessions: set[str] = set()
        self.ended: collections.OrderedDict[str, float] = collections.OrderedDict()  # said they ended -> when (newest last)
        self.remember = remember  # sessions that said they ended, kept to catch one that calls again
        self.checked: set[str] = set()  # sessions with a prediction checked (until forgotten)
        self.sessions_checked = 0
        self.wrong_count = 0  # sessions proved wrong and since forgotten

    def arrived(self, call: Call, gap_opened: float | None, now: float, p90_gap_s: float) -> None:
        """Checks what `call`'s session predicted (its gap opened at `gap_opened`; `p90_gap_s`: the
        observed p90 tool gap), then records `call`'s own hints."""
        sid = call.session
        while self.ended and now - next(iter(self.ended.values())) > p90_gap_s:  # ended sessions that stayed away
            self._checked(self.ended.popitem(last=False)[0])
        if self.ended.pop(sid, None) is not None:  # it said it had ended
            self._checked(sid)
            self.wrong_sessions.add(sid)
        h = self.latest.get(sid)
        if h is not None and (h.hints.calls_left is not None or h.hints.tool_s is not None):
            self._checked(sid)
            left, tool_s = h.hints.calls_left, h.hints.tool_s
            late = tool_s is not None and gap_opened is not None and now - gap_opened > within_margin(tool_s)
            if late or (left is not None and call.turn > h.turn + left):
                self.wrong_sessions.add(sid)
        if call.hints:
            self.latest[sid] = call
        else:  # hints hold for the call that carries them: without, the estimates again
            self.latest.pop(sid, None)

    def finished(self, call: Call, now: float) -> None:
        """Notes a finished call that said it ends its session (believed or not)."""
        if call.hints.calls_left == 0:
            self.ended.pop(call.session, None)
            self.ended[call.session] = now
            while len(self.ended) > self.remember:
                self.ended.popitem(last=False)

    def forget(self, session: str) -> None:
        """Drops `session` (what it proved stays counted)."""
        self.latest.pop(session, None)
        self.checked.discard(session)
        if session in self.wrong_sessions:
            self.wrong_sessions.discard(session)
            self.wrong_count += 1

    def _checked(self, sid: str) -> None:
        if sid not in self.checked:
            self.checked.add(sid)
            self.sessions_checked += 1

    @property
    def sessions_wrong(self) -> int:
        return self.wrong_count + len(self.wrong_sessions)

    def believed(self, sid: str) -> bool:
        """Whether `sid`'s predictions are used (see the module docstring)."""
        return sid not in self.wrong_sessions and self.sessions_checked >= self.min_checked and \
            self.sessions_wrong <= self.max_wrong * self.sessions_checked

    def of(self, call: Call) -> Hints:
        """What the scheduler takes of `call`'s hints: all of them if believed, else its priority."""
        if not call.hints or self.believed(call.session):
            return call.hints
        return Hints(priority=call.hints.priority)

    def session(self, sid: str) -> tuple[int, Hints] | None:
        """(turn, hints taken) of `sid`'s latest hinted call, or None."""
        h = self.latest.get(sid)
        return None if h is None else (h.turn, self.of(h))
