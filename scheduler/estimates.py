"""What the scheduler estimates online from what it observes: tool gaps (`ToolGaps`), calls per
agent session (`SessionLengths`) and seconds per call of each model (`CallTimes`). Plain Python,
no clock of its own: every method takes the time it is asked at."""
from __future__ import annotations

import collections
import statistics


class ToolGaps:
    """The tool gaps the scheduler sees: a gap opens when a session's call finishes and closes when
    its next call is issued. The p90 is over the last `window` closed gaps; until `min_seen` have
    closed it is the stated prior (docs/references.md's agent-session statistics:
    ``PolicyConfig.reserve_horizon_s``, 13.6 s). The mean is over every gap since the start, the
    ones still open included. A gap open longer than `max_gap_s` (the stated p99) is closed at that
    length: its session has most likely ended, or its next call went to another scheduler."""

    def __init__(self, prior_p90_s: float, prior_mean_s: float, max_gap_s: float, window: int = 256,
                 min_seen: int = 16):
        self.prior_p90_s = prior_p90_s
        self.prior_mean_s = prior_mean_s
        self.max_gap_s = max_gap_s
        self.seen: collections.deque[float] = collections.deque(maxlen=window)
        self.min_seen = min_seen
        self._p90: float | None = None
        self.open: dict[str, float] = {}  # session -> when its gap opened
        self._open_sum = 0.0  # sum of self.open's values
        self._closed_n = 0
        self._closed_sum = 0.0

    def begin(self, session: str, now: float) -> None:
        self.end(session, now, observe=False)
        self.open[session] = now  # appended: self.open stays in the order the gaps opened
        self._open_sum += now

    def end(self, session: str, now: float, observe: bool = True) -> bool:
        """Closes `session`'s open gap (a call issued: `observe` records it); whether one was open."""
        t = self.open.pop(session, None)
        if t is None:
            return False
        self._open_sum = self._open_sum - t if self.open else 0.0
        if observe:
            gap = max(0.0, now - t)
            self.seen.append(gap)
            self._p90 = None
            self._closed_n += 1
            self._closed_sum += gap
        return True

    def expire(self, now: float) -> list[str]:
        """Closes the gaps open longer than `max_gap_s` at that length; their sessions."""
        gone = []
        while self.open:  # the oldest open gap first
            session, t = next(iter(self.open.items()))
            if now - t <= self.max_gap_s:
                break
            self.end(session, t + self.max_gap_s)
            gone.append(session)
        return gone

    def mean(self, now: float) -> float:
        """The mean gap: the time spent in gaps, closed or still open, per closed gap (the maximum-
        likelihood mean of exponential gaps, which counts the long gaps still running that a mean
        of the closed ones would miss), the stated prior counted as one closed gap. Expires first."""
        self.expire(now)
        running = max(0.0, len(self.open) * now - self._open_sum)
        return (self.prior_mean_s + self._closed_sum + running) / (1 + self._closed_n)

    def p90(self) -> float:
        """The 0.9 quantile of the gaps seen (linear interpolation, as numpy's default), or the prior."""
        if len(self.seen) < self.min_seen:
            return self.prior_p90_s
        if self._p90 is None:
            v = sorted(self.seen)
            pos = 0.9 * (len(v) - 1)
            k = int(pos)
            self._p90 = v[k] + (pos - k) * (v[min(k + 1, len(v) - 1)] - v[k])
        return self._p90


class SessionLengths:
    """Calls per agent session, estimated online with no prior, so a server schedules by it from its
    first minute on sessions of any length.

    The data are the sessions seen: an ended session's calls (an event), and the calls each running
    session has issued so far (censored: it has at least that many). `left(k)` is the expected calls
    left to a session that has completed `k`, E[N - k | N > k], from the Kaplan-Meier estimate of
    P(N > j) over these data, so the long sessions still running count (a mean over the ended ones
    alone would see only the short). Past the most calls any session has made (top), the tail is
    scale-free: a session that has made top calls makes about top more (the delta-t argument).
    Before any session has ended that gives top - k + top: a server whose sessions have made 3 calls
    expects a few more, not the tens a fixed prior would. A session whose tool gap passed the stated
    p99 counts as ended (`end(..., reopen=True)`); if it comes back, its end is taken back."""

    def __init__(self):
        self.running: dict[str, int] = {}  # session -> calls issued
        self.seen: collections.Counter[int] = collections.Counter()  # calls observed -> sessions (ended or running)
        self.ended: collections.Counter[int] = collections.Counter()  # calls -> sessions that ended with as many
        self.closed: dict[str, int] = {}  # sessions ended by a long gap, which may still return -> their calls
        self._left: list[float] | None = None

    def issued(self, session: str, calls: int) -> None:
        """`session` has issued `calls` calls (its call of turn calls - 1 arrived)."""
        n = self.closed.pop(session, None)
        if n is not None:  # back after a gap past the p99: it had not ended
            self.ended[n] -= 1
            self.seen[n] -= 1
        old = self.running.get(session)
        if old is not None:
            self.seen[old] -= 1
        self.running[session] = calls
        self.seen[calls] += 1
        self._left = None

    def end(self, session: str, calls: int | None = None, reopen: bool = False) -> None:
        """`session` ended after `calls` calls (None: those it issued); `reopen`: it may yet return."""
        old = self.running.pop(session, None)
        if old is None:
            return  # never issued a call here, or already ended
        self.seen[old] -= 1
        n = old if calls is None else calls
        self.seen[n] += 1
        self.ended[n] += 1
        if reopen:
            self.closed[session] = n
        self._left = None

    def forget(self, session: str) -> None:
        """Stops tracking `session` (its counts stay)."""
        self.closed.pop(session, None)

    def left(self, k: int) -> float:
        """The expected calls left to a session that has completed `k` calls (at least 1)."""
        if self._left is None:
            self._left = self._curve()
        return self._left[k] if k < len(self._left) else max(float(k), 1.0)

    def _curve(self) -> list[float]:
        top = max((j for j, n in self.seen.items() if n > 0), default=0)
        at_risk = [0] * (top + 2)  # sessions observed with at least j calls
        for j, n in self.seen.items():
            at_risk[j] += n
        for j in range(top - 1, -1, -1):
            at_risk[j] += at_risk[j + 1]
        surv = [1.0] * (top + 1)  # P(N > j); every session makes a call
        for j in range(1, top + 1):
            d = self.ended.get(j, 0)
            surv[j] = surv[j - 1] * (1.0 - d / at_risk[j]) if at_risk[j] else surv[j - 1]
        tail = surv[top] * max(top, 1)  # sum over j >= top of P(N > j): about top more calls
        out = [0.0] * (top + 1)
        for k in range(top, -1, -1):
            out[k] = tail / surv[k] if surv[k] > 0 else max(float(k), 1.0)
            tail += surv[k - 1] if k else 0.0
        return [max(x, 1.0) for x in out]


class CallTimes:
    """Seconds a call of each model takes once admitted: a moving mean (weight `rate` on each new
    call) that starts at the median of the first `first` calls, each later call clipped to within
    `clip` times the mean, so the few calls that also paid a compilation or a model switch barely
    move it."""

    def __init__(self, rate: float = 0.1, first: int = 4, clip: float = 4.0):
        self.rate, self.first, self.clip = rate, first, clip
        self.mean: dict[str, float] = {}
        self._first: dict[str, list[float]] = {}

    def add(self, model: str, seconds: float) -> None:
        early = self._first.setdefault(model, [])
        if len(early) < self.first:
            early.append(seconds)
            self.mean[model] = statistics.median(early)
            return
        m = self.mean[model]
        self.mean[model] = m + self.rate * (min(max(seconds, m / self.clip), m * self.clip) - m)

    def get(self, model: str) -> float | None:
        """The mean, or None before a call of `model` has finished."""
        return self.mean.get(model)
