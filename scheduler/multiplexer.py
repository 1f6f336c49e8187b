"""Round-based model multiplexing on one instance: the active model's slot, its length, the switch.

A slot's length follows the switches it amortises: a slot opens at most ``slot_s`` long and, the
first time another model waits, is bounded to ``switches_per_slot`` times the summed cost of
switching to each model waiting at that moment (no shorter than ``min_slot_s``; later waiters do
not move the bound). A slot before a full PCIe weight load therefore stays
long enough that switching is a bounded fraction of time, while a slot before the free activation
of a resident model (or a D2D copy of a staged one) ends soon, and the waiting model is served
sooner. Without ``switches_per_slot`` every slot is ``slot_s`` long (a fixed quantum).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass
class Slot:
    model: str
    opened_s: float
    deadline_s: float
    bounded: bool = False  # the deadline already follows the cost of the switch out of this slot


class RoundMultiplexer:
    """Slots visit models in a fixed round-robin order, skipping models with no demand, unless the
    scheduler passes a priority per model (``PolicyConfig.slot_order``)."""

    def __init__(self, order: Iterable[str], slot_s: float, switches_per_slot: float | None = None,
                 min_slot_s: float = 0.0):
        self.order = tuple(order)
        if not self.order:
            raise ValueError("RoundMultiplexer needs at least one model")
        if slot_s <= 0:
            raise ValueError(f"slot_s={slot_s} must be > 0")
        if switches_per_slot is not None and switches_per_slot <= 0:
            raise ValueError(f"switches_per_slot={switches_per_slot} must be > 0 (or None for a fixed slot)")
        if not 0 <= min_slot_s <= slot_s:
            raise ValueError(f"min_slot_s={min_slot_s} must be in [0, slot_s={slot_s}]")
        self.slot_s = slot_s
        self.switches_per_slot = switches_per_slot
        self.min_slot_s = min_slot_s
        self.slot: Slot | None = None
        self.last_model: str | None = None

    def next_model(self, demand: set[str], priority: dict[str, float] | None = None) -> str | None:
        """The first model after the last slot's model, in round order, that has demand; the last
        slot's own model comes last (it gets another slot only when no other model waits). With
        `priority` (model -> weight) the model of highest weight goes first, ties in that order."""
        if not demand:
            return None
        start = self.order.index(self.last_model) + 1 if self.last_model in self.order else 0
        ring = [self.order[(start + k) % len(self.order)] for k in range(len(self.order))]
        cands = [m for m in ring if m in demand]
        if not cands:
            return None
        if priority:
            return max(cands, key=lambda m: priority.get(m, 0.0))  # max keeps the first of equals
        return cands[0]

    def after(self, model: str, demand: set[str], priority: dict[str, float] | None = None) -> str | None:
        """The model whose slot would follow `model`'s, given demand (for staging ahead)."""
        saved = self.last_model
        self.last_model = model
        try:
            nxt = self.next_model(demand - {model}, priority)
        finally:
            self.last_model = saved
        return nxt

    def slot_length(self, switch_s: float) -> float:
        """Length of a slot that amortises a switch of `switch_s` seconds."""
        if self.switches_per_slot is None:
            return self.slot_s
        return min(self.slot_s, max(self.min_slot_s, self.switches_per_slot * switch_s))

    def open(self, model: str, now: float) -> Slot:
        self.slot = Slot(model, now, now + self.slot_s)
        self.last_model = model
        return self.slot

    def bound(self, switch_s: float) -> None:
        """Bounds the open slot by the cost of the switch out of it, once: call it when another
        model first waits, before that model's weights are staged (the staging copy is what the
        slot hides, so the pre-staging estimate is the cost to amortise)."""
        s = self.slot
        if s is not None and not s.bounded:
            s.deadline_s = min(s.deadline_s, s.opened_s + self.slot_length(switch_s))
            s.bounded = True

    def close(self) -> None:
        self.slot = None

    def is_open(self, now: float) -> bool:
        return self.slot is not None and now < self.slot.deadline_s
