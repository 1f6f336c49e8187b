"""The admission budget of one instance, with soft reservations for sessions likely to return.

When a session's call finishes, the pages its next call is expected to need are charged to the
budget of the instance that served it. The charge decays linearly to zero over the horizon and then
lapses; the session's return releases it. A reservation never blocks work that would otherwise sit
idle: an instance with nothing running or waiting admits regardless of charges.
"""
from __future__ import annotations

import dataclasses
import math

from talaria_jax.scheduler.api import InstanceAPI


@dataclasses.dataclass(frozen=True)
class Reservation:
    session: str
    model: str
    pages: int
    start_s: float
    horizon_s: float
    back_s: float | None = None  # when the agent said the session's next call comes (Hints.tool_s); None: unknown

    def charge(self, now: float) -> float:
        """Pages charged at `now`: full at the start, linearly down to 0 at start + horizon."""
        if now < self.start_s:
            return float(self.pages)
        return self.pages * max(0.0, 1.0 - (now - self.start_s) / self.horizon_s)

    def live(self, now: float) -> bool:
        return now < self.start_s + self.horizon_s


class AdmissionBudget:
    """Soft reservations held against one instance's KV pages."""

    def __init__(self, horizon_s: float):
        if horizon_s <= 0:
            raise ValueError(f"reservation horizon_s={horizon_s} must be > 0")
        self.horizon_s = horizon_s
        self.reservations: dict[str, Reservation] = {}

    def reserve(self, session: str, model: str, pages: int, now: float, horizon_s: float | None = None,
                back_s: float | None = None) -> Reservation:
        """Charges `pages` for `session`'s return over `horizon_s` (default: the budget's horizon)."""
        r = Reservation(session, model, pages, now, horizon_s or self.horizon_s, back_s)
        self.reservations[session] = r
        return r

    def release(self, session: str) -> None:
        self.reservations.pop(session, None)

    def expire(self, now: float) -> list[str]:
        """Drops lapsed reservations; returns their sessions."""
        gone = [s for s, r in self.reservations.items() if not r.live(now)]
        for s in gone:
            del self.reservations[s]
        return gone

    def charged_pages(self, now: float, exclude: str | None = None) -> int:
        return math.ceil(sum(r.charge(now) for s, r in self.reservations.items() if s != exclude) - 1e-9)

    def live_for(self, model: str, now: float) -> list[Reservation]:
        return [r for r in self.reservations.values() if r.model == model and r.live(now)]

    def fits(self, inst: InstanceAPI, session: str, pages: int, now: float) -> bool:
        """Whether `pages` more for `session` fit the budget: pages not used by admitted calls minus
        other sessions' charges. An idle instance always admits (reservations never idle a GPU)."""
        if inst.num_running() == 0 and inst.num_waiting() == 0:
            return True
        room = inst.kv_pages_total() - inst.kv_pages_used() - self.charged_pages(now, exclude=session)
        return pages <= room
