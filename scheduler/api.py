"""The only view the scheduler has of a serving instance: the ``InstanceAPI`` protocol.

``talaria_jax.instance.Instance`` implements it over real JAX engines and
``talaria_jax.sim.SimInstance`` over a cost model and a virtual clock; the scheduler imports
neither. KV capacity is counted in uniform pages of ``page_bytes`` (one pool shared by all models).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Protocol, Sequence, runtime_checkable

from talaria_jax.scheduler.session import Call


class WeightState(enum.Enum):
    """Where one model's weights are, from the point of view of a switch to it."""

    ACTIVE = "active"  # in the weight slot and serving; no switch needed
    RESIDENT = "resident"  # on device but not serving; a switch only activates it
    STAGED = "staged"  # fully copied into the staging area; a switch is a device-to-device copy
    STAGING = "staging"  # host-to-device copy into the staging area in progress
    HOST = "host"  # only in host memory; a switch loads every byte over PCIe


@dataclasses.dataclass
class InstanceStats:
    """What an instance did, counted the same way by both backends (reports and the replay's tables)."""
    switches: int = 0
    pauses: int = 0  # switches that paused the active model's running calls (`switch_model(pause=True)`)
    switch_s: float = 0.0
    compile_s: float = 0.0  # tracing and compiling left out of the chunks' seconds (a real instance's replay clock)
    restored_tokens: int = 0  # prefix tokens restored from host memory
    recomputed_tokens: int = 0  # prefix tokens that an earlier call computed, prefilled again
    device_hit_tokens: int = 0  # prefix tokens found on device
    prefill_tokens: int = 0
    peak_device_bytes: float = 0.0
    peak_kv_pages: int = 0
    chunks: int = 0  # chunks started (switches, prefills, decode runs)
    truncated_chunks: int = 0  # decode chunks cut short by `truncate_chunk`
    switch_log: list = dataclasses.field(default_factory=list)  # (start time, model, seconds)


@dataclasses.dataclass(frozen=True)
class PrefixLocation:
    """Tokens of a session's KV prefix held for one model: on device, and restorable from host."""

    device_tokens: int = 0
    host_tokens: int = 0


class DerivedQueries:
    """The queries of `InstanceAPI` that follow from its others, written once: a backend class
    inherits them (the real instance, the simulated one, the gateway's view of a probe answer)."""

    def kv_pages_free(self) -> int:
        """Pages neither in use nor reserved for likely returns."""
        return max(0, self.kv_pages_total() - self.kv_pages_used() - self.kv_pages_reserved())

    def pressure(self) -> float:
        """The share of the pages in use or reserved (1.0 for an instance with none)."""
        total = self.kv_pages_total()
        return 1.0 if total <= 0 else (self.kv_pages_used() + self.kv_pages_reserved()) / total


@runtime_checkable
class InstanceAPI(Protocol):
    """One serving instance (one TP group). Methods are cheap queries unless documented as actions.

    Actions (admit, abort, switch_model, stage_model, protect_kv) only record intent; the backend
    carries them out at its next step boundary, so the scheduler never waits on device work.
    """

    name: str

    # weights
    def models(self) -> tuple[str, ...]: ...
    def active_model(self) -> str | None: ...
    def weight_state(self, model: str) -> WeightState: ...
    def estimate_switch_s(self, model: str) -> float: ...

    # KV pages (uniform pages shared by all models)
    def pages_for(self, model: str, tokens: int) -> int: ...
    def kv_pages_total(self) -> int: ...
    def kv_pages_used(self) -> int: ...
    def kv_pages_free(self) -> int: ...
    def kv_pages_reserved(self, exclude_session: str | None = None) -> int: ...  # idle KV kept for likely returns
    def cached_prefix(self, session_id: str, model: str) -> PrefixLocation: ...

    # queue and pressure
    def num_waiting(self) -> int: ...
    def num_running(self) -> int: ...  # the paused calls included
    def num_paused(self) -> int: ...  # calls a switch paused (`switch_model(pause=True)`), of inactive models
    def drain_s(self) -> float: ...  # seconds until the active model's running calls end
    # the two switches of pausing for `model` to prefill `pages` more KV pages: to it and back (inf: no room)
    def pause_cost_s(self, model: str, pages: int) -> float: ...
    def is_busy(self) -> bool: ...
    def pressure(self) -> float: ...
    def estimate_service_s(self, call: Call) -> float: ...
    def estimate_batch_s(self, calls: Sequence[Call]) -> float: ...  # one model's calls run together on their own

    # actions
    def admit(self, call: Call) -> None: ...
    def abort(self, call: Call) -> bool: ...
    def switch_model(self, model: str, pause: bool = False) -> None: ...
    def stage_model(self, model: str) -> bool: ...
    def protect_kv(self, session_id: str, until_s: float) -> None: ...
