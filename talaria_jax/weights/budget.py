"""Models that keep their own device arrays and take turns on the devices under a byte budget.

An instance whose devices cannot hold every model's weights keeps each model's parameters in host
memory (each shard beside its device, pinned where the backend has it: `jax.device_put` to the host
memory kind, so nothing is gathered whole) and as many models on the devices, in arrays of their own,
as `budget_bytes` allows. (The models arrive on the devices and are copied to host memory from there,
so the devices hold them all once, at start: a CPU's do.) Bringing a model in (`load`) evicts the
least recently used others until it fits and copies it host-to-device (a real copy, as on a GPU; no
program to compile), or takes the copy `stage` started earlier while another model served. A step
reads a model's own arrays, so nothing is copied per step (a `WeightSlot` is carved inside every step
instead, which XLA:CPU pays with a copy of every parameter). Whoever owns the models' engines learns
of each placement through `place(model, state or None)`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from talaria_jax.kvcache import host_tier
from talaria_jax.kvcache.host_tier import host_memory_kind
from talaria_jax.models.model import ShardedModel


def held_bytes(model: ShardedModel) -> int:
    """Bytes `model`'s parameters take on the devices, summed over them (replicas included)."""
    return sum(host_tier.held_bytes(v.sharding, v.shape, v.dtype) for v in jax.tree.leaves(model.state))


class DeviceWeights:
    """Which of `models` have their arrays on the devices, within `budget_bytes` over all devices. Their
    parameters are copied to host memory here (the callers may then
    drop their device arrays); `place(model, state)` is called with a model's arrays when they arrive and
    with None when they are evicted. Every model starts in host memory only."""

    def __init__(self, models: Mapping[str, ShardedModel], budget_bytes: int,
                 place: Callable[[str, Any], None]):
        self.budget_bytes = budget_bytes
        self._place = place
        self._bytes = {m: held_bytes(model) for m, model in models.items()}
        for m, n in self._bytes.items():
            if n > budget_bytes:
                raise ValueError(f"weight_budget_bytes ({budget_bytes}) is smaller than {m}'s weights "
                                 f"({n} bytes over all devices)")
        self._shardings = {m: jax.tree.map(lambda v: v.sharding, model.state) for m, model in models.items()}
        self._host = {}
        for m, model in models.items():
            kind = host_memory_kind(model.mesh)
            self._host[m] = jax.device_get(model.state) if kind is None else \
                jax.device_put(model.state, jax.tree.map(lambda s: s.with_memory_kind(kind), self._shardings[m]))
        jax.block_until_ready(self._host)
        self._on: dict[str, None] = {}  # models on the devices, least recently used first
        self._staging: tuple[str, Any] | None = None  # a model on its way to the devices, and its arrays
        self.loads = 0  # host-to-device copies started (loads and stagings)

    def nbytes(self, model: str) -> int:
        """Bytes of `model`'s weights over all devices."""
        return self._bytes[model]

    def _to_device(self, model: str) -> Any:
        """A host-to-device copy of `model`'s parameters, started (not waited for)."""
        self.loads += 1
        return jax.device_put(self._host[model], self._shardings[model])

    def on_device(self, model: str) -> bool:
        return model in self._on

    @property
    def staging(self) -> str | None:
        """The model being staged (its copy started, not yet loaded), or None."""
        return self._staging[0] if self._staging is not None else None

    def staged_ready(self) -> bool:
        """Whether the staged model's arrays have all arrived."""
        return self._staging is not None and all(a.is_ready() for a in jax.tree.leaves(self._staging[1]))

    def device_bytes(self) -> int:
        """Bytes of the models on the devices and of the one being staged, over all devices."""
        staged = self.nbytes(self._staging[0]) if self._staging is not None else 0
        return sum(self.nbytes(m) for m in self._on) + staged

    def fits(self, model: str, keep: str | None) -> bool:
        """Whether `model` fits the budget beside `keep` (and a model being staged), others evicted."""
        held = self.nbytes(keep) if keep is not None and keep in self._on else 0
        staged = self.nbytes(self._staging[0]) if self._staging is not None else 0
        return held + staged + self.nbytes(model) <= self.budget_bytes

    def _room(self, need: int, keep: set[str]) -> bool:
        """Evicts the least recently used models outside `keep` until `need` more bytes fit the budget;
        False (nothing evicted) where even evicting them all would not make room."""
        victims = [m for m in self._on if m not in keep]
        free = self.budget_bytes - self.device_bytes()
        if free + sum(self.nbytes(m) for m in victims) < need:
            return False
        for m in victims:
            if free >= need:
                break
            self.evict(m)
            free += self.nbytes(m)
        return True

    def stage(self, model: str, keep: str | None) -> bool:
        """Starts copying `model` to the devices and returns at once (`keep`, the active model, goes on
        serving): evicts other models if that makes room. False where it does not fit beside `keep`,
        or another model is being staged."""
        if model in self._on or self.staging == model:
            return True
        if self._staging is not None or not self._room(self.nbytes(model), {keep} if keep else set()):
            return False
        self._staging = (model, self._to_device(model))
        return True

    def wait_staged(self) -> None:
        """Blocks until the staged model's arrays have arrived (at once when nothing is staged)."""
        if self._staging is not None:
            jax.block_until_ready(self._staging[1])

    def drop_staged(self) -> None:
        self._staging = None

    def load(self, model: str) -> None:
        """Puts `model`'s arrays on the devices (the staged copy, or a copy from host memory now, after
        evicting the least recently used models it needs room from) and blocks until they are there."""
        if model in self._on:
            self._on[model] = self._on.pop(model)  # most recently used
            return
        if self.staging == model:
            state = self._staging[1]
        else:
            self._staging = None  # one staging copy: whatever it held goes
            self._room(self.nbytes(model), set())
            state = self._to_device(model)
        self._staging = None
        jax.block_until_ready(state)
        self._on[model] = None
        self._place(model, state)

    def evict(self, model: str) -> None:
        """`model` back to host memory only (its staging copy dropped too)."""
        if self.staging == model:
            self._staging = None
        if model in self._on:
            del self._on[model]
            self._place(model, None)

    def evict_all(self) -> None:
        """Every model back to host memory only (a replay's fresh start)."""
        self._staging = None
        for m in list(self._on):
            self.evict(m)
