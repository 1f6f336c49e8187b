"""Round-based model multiplexing on one instance: the active model's slot, its length, the switch."""
from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass
class Slot:
    model: str
    opened_s: float
    deadline_s: float


class RoundMultiplexer:
    """Slots visit models in a fixed round-robin order, skipping models with no demand."""

    def __init__(self, order: Iterable[str], slot_s: float):
        self.order = tuple(order)
        if not self.order:
            raise ValueError("RoundMultiplexer needs at least one model")
        if slot_s <= 0:
            raise ValueError(f"slot_s={slot_s} must be > 0")
        self.slot_s = slot_s
        self.slot: Slot | None = None
        self.last_model: str | None = None

    def next_model(self, demand: set[str]) -> str | None:
        """The first model after the last slot's model, in round order, that has demand; the last
        slot's own model comes last (it gets another slot only when no other model waits)."""
        if not demand:
            return None
        start = self.order.index(self.last_model) + 1 if self.last_model in self.order else 0
        for k in range(len(self.order)):
            m = self.order[(start + k) % len(self.order)]
            if m in demand:
                return m
        return None

    def after(self, model: str, demand: set[str]) -> str | None:
        """The model whose slot would follow `model`'s, given demand (for staging ahead)."""
        saved = self.last_model
        self.last_model = model
        try:
            nxt = self.next_model(demand - {model})
        finally:
            self.last_model = saved
        return nxt

    def open(self, model: str, now: float) -> Slot:
        self.slot = Slot(model, now, now + self.slot_s)
        self.last_model = model
        return self.slot

    def close(self) -> None:
        self.slot = None

    def is_open(self, now: float) -> bool:
        return self.slot is not None and now < self.slot.deadline_s
