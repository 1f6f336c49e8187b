"""``SimInstance``: one TP instance over a virtual clock and the roofline cost model.

It implements ``InstanceAPI``. Work happens in chunks started by ``start_chunk`` and finished by
``finish_chunk`` at the time the chunk returned: a model switch, one prefill of the admitted calls
(prefill first, as vLLM's default scheduler does), or k decode steps of the running batch. HBM is
accounted in bytes (weights of resident/staged models + KV pages) and never exceeds the usable HBM.
While a staging copy is in flight, prefill and decode work runs `HardwareConfig.staging_step_slowdown`
times slower (``_staging_stretch_s``); switches and KV restores do not.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
from typing import Callable, Sequence

import numpy as np

from talaria_jax.scheduler.api import DerivedQueries, InstanceStats, PrefixLocation, WeightState
from talaria_jax.scheduler.session import Call
from talaria_jax.sim.cost import CostModel
from talaria_jax.sim.hardware import HardwareConfig, ModelShape

_ON_DEVICE = (WeightState.ACTIVE, WeightState.RESIDENT, WeightState.STAGED, WeightState.STAGING)


class CapacityError(RuntimeError):
    """A call cannot fit the instance even with everything evictable evicted."""


@dataclasses.dataclass
class _Req:
    call: Call
    ctx: int  # tokens in KV now
    remaining: int  # decode steps left
    admitted_s: float


@dataclasses.dataclass
class _DevKV:
    model: str
    tokens: int  # tokens allocated (the valid prefix once the call has finished)
    last_used: float
    protect_until: float = -math.inf
    in_use: bool = False


@dataclasses.dataclass(frozen=True)
class Switch:
    """A chunk that makes `model` the active one."""
    model: str


@dataclasses.dataclass(frozen=True)
class Prefill:
    """A chunk that prefills the admitted calls of `batch` (host-KV restores first)."""
    batch: tuple[_Req, ...]


@dataclasses.dataclass(frozen=True)
class Decode:
    """A chunk of `steps` decode steps of the running batch (`batch` calls, `ctx` tokens of context)
    on `shape`, started at `start`: `step0` seconds its first step takes, `slow` the end of a staging
    copy's slowdown window (None: none), `jitter` the run-to-run factor drawn at its start."""
    steps: int
    start: float
    shape: ModelShape
    batch: int
    ctx: int
    step0: float
    slow: float | None
    jitter: float


class SimInstance(DerivedQueries):
    """A simulated instance; see the module docstring. `reusable_prefix(call)` gives the tokens of
    call's prompt that earlier calls of its session computed KV for on its model, wherever they ran
    (``session.reusable_prefixes``), for the recomputed-token count (None: nothing counts as
    recomputed). A compaction elsewhere cuts the session's KV held here (`cut_kv`)."""

    def __init__(self, name: str, hw: HardwareConfig, shapes: dict[str, ModelShape], models: Sequence[str], *,
                 host_kv: bool, staging: bool, drop_kv_on_switch: bool, page_bytes: int = 4 * 2**20,
                 reusable_prefix: Callable[[Call], int] | None = None, jitter_sigma: float = 0.0,
                 rng: np.random.Generator | None = None):
        for m in models:
            if m not in shapes:
                raise ValueError(f"instance {name}: model {m!r} has no shape in the models table")
            if shapes[m].tp != hw.num_gpus:
                raise ValueError(f"instance {name}: the shape of {m!r} is for TP={shapes[m].tp} but hardware {hw.name!r} "
                                 f"has num_gpus={hw.num_gpus} (load_models(tp=...) or the table's tensor_parallel)")
        self.name = name
        self.hw, self.cost = hw, CostModel(hw)
        self.shapes = shapes
        self._models = tuple(models)
        self.host_kv, self.staging, self.drop_kv_on_switch = host_kv, staging, drop_kv_on_switch
        self.page_bytes = page_bytes
        self.reusable_prefix = reusable_prefix
        self.jitter_sigma = jitter_sigma
        self.rng = rng or np.random.default_rng(0)
        self.capacity = hw.usable_hbm_bytes
        # all models' weights live in host memory; what is left holds host KV
        self.host_kv_capacity = hw.host_kv_bytes_budget - sum(shapes[m].weight_bytes for m in models)
        if self.host_kv_capacity < 0 and host_kv:
            raise ValueError(f"instance {name}: host memory {hw.host_memory_gb} GB cannot hold the weights of {models}")
        self.weights = {m: WeightState.HOST for m in models}
        self._kv_bytes_per_token = {m: shapes[m].kv_bytes_per_token for m in models}
        # Derived figures the router reads for every placement, cached until the state they derive
        # from changes (`_touch`): weight bytes on device, the protected idle KV. The device KV
        # pages and the pages of calls in flight are running counts (tests check them against sums).
        self._cache: dict = {}
        self._dev_pages = 0
        self._flight_pages = 0  # pages of the calls waiting or running: each holds its context_after
        self._protected_sids: dict[tuple[str, str], None] = {}  # KV that protect_kv protected (see _protected)
        self._protect_pruned_s = -math.inf
        self._host_bytes = 0  # bytes of kv_host
        self._weights_version = 0  # counts weight-state changes
        self._active: str | None = None
        self._staging_model: str | None = None
        self._staging_start = 0.0
        # a session's KV per model: (session, model) -> its device KV, its host copy (model, tokens)
        self.kv_dev: dict[tuple[str, str], _DevKV] = {}
        self.kv_host: collections.OrderedDict[tuple[str, str], tuple[str, int]] = collections.OrderedDict()
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []  # the active model's calls in flight
        self.paused: dict[str, list[_Req]] = {}  # model -> its calls a switch paused, their KV kept on device
        self.now = 0.0
        self.busy_until: float | None = None
        self.chunk: Switch | Prefill | Decode | None = None  # the chunk in flight
        self._switch_to: str | None = None
        self._weights_lru: dict[str, float] = {}
        self.stats = InstanceStats()

    # --- InstanceAPI: weights ---------------------------------------------------------------
    def models(self) -> tuple[str, ...]:
        return self._models

    def active_model(self) -> str | None:
        return self._active

    def weight_state(self, model: str) -> WeightState:
        self._update_staging(self.now)
        return self.weights[model]

    def estimate_switch_s(self, model: str) -> float:
        s = self.weight_state(model)
        m = self.shapes[model]
        if s in (WeightState.ACTIVE, WeightState.RESIDENT):
            return 0.0
        if s == WeightState.STAGED:
            return self.cost.d2d_weights_s(m)
        if s == WeightState.STAGING:
            left = m.weight_bytes - (self.now - self._staging_start) * self.cost.weight_load_rate()
            return max(0.0, left) / self.cost.weight_load_rate() + self.cost.d2d_weights_s(m)
        return self.cost.weight_load_s(m)

    # --- InstanceAPI: KV pages --------------------------------------------------------------
    def pages_for(self, model: str, tokens: int) -> int:
        kvb = self._kv_bytes_per_token.get(model)
        if kvb is None:
            kvb = self.shapes[model].kv_bytes_per_token
        return math.ceil(tokens * kvb / self.page_bytes)

    def _touch(self) -> None:
        """Drops the cached figures: the KV entries, the waiting queue or the weights changed."""
        self._cache.clear()

    def _set_weight(self, model: str, state: WeightState) -> None:
        self.weights[model] = state
        self._weights_version += 1
        self._touch()

    @property
    def weights_version(self) -> int | None:
        """Changes whenever a switch estimate may have changed; None while a staging copy is in flight
        (its estimate shrinks with time)."""
        m = self._staging_model
        if m is not None and self.weight_state(m) == WeightState.STAGING:
            return None
        return self._weights_version

    def _set_kv_tokens(self, e: _DevKV, tokens: int) -> None:
        self._dev_pages += self.pages_for(e.model, tokens) - self.pages_for(e.model, e.tokens)
        e.tokens = tokens
        self._touch()

    def _weights_bytes(self) -> float:
        v = self._cache.get("weights")
        if v is None:
            v = self._cache["weights"] = sum(self.shapes[m].weight_bytes for m, s in self.weights.items() if s in _ON_DEVICE)
        return v

    def _kv_dev_pages(self) -> int:
        return self._dev_pages

    def _kv_dev_pages_slow(self) -> int:  # what _dev_pages counts (tests check the two agree)
        return sum(self.pages_for(e.model, e.tokens) for e in self.kv_dev.values())

    def device_bytes(self) -> float:
        return self._weights_bytes() + self._kv_dev_pages() * self.page_bytes

    def kv_pages_total(self) -> int:
        return int((self.capacity - self._weights_bytes()) // self.page_bytes)

    def kv_pages_used(self) -> int:
        """Pages held by running calls plus pages that waiting calls will need. A waiting call's
        device prefix (marked in use at admission) is part of what it will need, not counted twice."""
        return self._flight_pages  # a running call's device KV holds its context_after tokens

    def _kv_pages_used_slow(self) -> int:
        waiting = {(r.call.session, r.call.model) for r in self.waiting}
        held = sum(self.pages_for(e.model, e.tokens) for key, e in self.kv_dev.items() if e.in_use and key not in waiting)
        need = sum(self.pages_for(r.call.model, r.call.context_after) for r in self.waiting)
        return held + need

    def kv_pages_reserved(self, exclude_session: str | None = None) -> int:
        """Pages of idle KV protected for sessions likely to return, other than `exclude_session`
        (a returning session's own protected KV is what it will use, not pressure against it)."""
        until, after = self._protected()
        pages = after[bisect.bisect_right(until, self.now)]
        if exclude_session is not None:
            for _, e in self._session_kv(exclude_session):
                if not e.in_use and e.protect_until > self.now:
                    pages -= self.pages_for(e.model, e.tokens)
        return pages

    def _session_kv(self, sid: str) -> list[tuple[tuple[str, str], _DevKV]]:
        """The session's device KV, one per model it ran on here."""
        return [((sid, m), e) for m in self._models if (e := self.kv_dev.get((sid, m))) is not None]

    def _protected(self) -> tuple[list[float], list[int]]:
        """The idle KV protected beyond now: protection ends in order, and the pages protected from
        each on (a suffix sum), valid from now until the next change (`_touch`). Only sessions
        `protect_kv` was called for are looked at, and those whose protection had lapsed are
        forgotten (a protection only moves by `protect_kv`, which remembers the session again)."""
        prot = self._cache.get("protected")
        if prot is not None and prot[2] <= self.now:
            return prot[0], prot[1]
        now = self.now
        if now >= self._protect_pruned_s:
            self._protect_pruned_s = now
            sids = self._protected_sids
            for key in [key for key in sids if (e := self.kv_dev.get(key)) is None or e.protect_until <= now]:
                del sids[key]
        else:  # asked about an earlier time than already pruned at: look at every entry
            sids = self.kv_dev
        items = sorted((e.protect_until, self.pages_for(e.model, e.tokens))
                       for e in map(self.kv_dev.get, sids) if not e.in_use and e.protect_until > now)
        after = list(itertools.accumulate(p for _, p in reversed(items)))[::-1] + [0]
        self._cache["protected"] = ([u for u, _ in items], after, now)
        return [u for u, _ in items], after

    def _kv_pages_reserved_slow(self, exclude_session: str | None = None) -> int:
        return sum(self.pages_for(e.model, e.tokens) for (sid, _), e in self.kv_dev.items()
                   if not e.in_use and e.protect_until > self.now and sid != exclude_session)

    def routing_valid_until(self, now: float) -> float:
        """Until when the router's figures (switch estimates, KV pages used, reserved and total, queue
        lengths) stay what they are at `now` if nothing is done to the instance: `now` while a staging
        copy is in flight (the switch estimate shrinks with it), else the next lapse of a KV protection."""
        self.now = now
        m = self._staging_model
        if m is not None and self.weight_state(m) == WeightState.STAGING:
            return now
        until = self._protected()[0]
        k = bisect.bisect_right(until, now)
        return until[k] if k < len(until) else math.inf

    def cached_prefix(self, session_id: str, model: str) -> PrefixLocation:
        e = self.kv_dev.get((session_id, model))
        dev = e.tokens if e is not None and not e.in_use else 0
        h = self.kv_host.get((session_id, model))
        host = h[1] if self.host_kv and h is not None else 0
        return PrefixLocation(dev, host)

    # --- InstanceAPI: queue -----------------------------------------------------------------
    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running) + self.num_paused()

    def num_paused(self) -> int:
        return sum(len(v) for v in self.paused.values())

    def drain_s(self) -> float:
        """Seconds until the active model's running calls end: their longest run of decode steps at
        the batch's step time now (what waiting for them costs a call of another model)."""
        if not self.running:
            return 0.0
        return self.cost.decode_run_s(self.shapes[self._active], len(self.running), sum(r.ctx for r in self.running),
                                      max(r.remaining for r in self.running))

    def pause_cost_s(self, model: str, pages: int) -> float:
        """Seconds of the two switches a pause for `model` costs: to it, and back to the active model,
        a reload unless both models' weights fit beside the KV in flight; inf where `model`'s weights
        and `pages` more KV pages do not fit beside the KV of the calls it would pause."""
        a, m = self._active, self.shapes[model]
        # what a switch cannot evict: the KV in flight (the paused calls' and the waiting calls'), and
        # what a pause should not cost: a staging area's model (a switch gives it up only as a last resort)
        fixed = (self._flight_pages + pages) * self.page_bytes + sum(
            self.shapes[o].weight_bytes for o, s in self.weights.items()
            if o != model and s in (WeightState.STAGED, WeightState.STAGING))
        if fixed + m.weight_bytes > self.capacity:
            return math.inf
        back = 0.0
        if a is not None and fixed + m.weight_bytes + self.shapes[a].weight_bytes > self.capacity:
            back = self.cost.weight_load_s(self.shapes[a])
        return self.estimate_switch_s(model) + back

    def is_busy(self) -> bool:
        return self.busy_until is not None

    def estimate_service_s(self, call: Call) -> float:
        m = self.shapes[call.model]
        loc = self.cached_prefix(call.session, call.model)
        cached = min(call.max_prefix_tokens, max(loc.device_tokens, loc.host_tokens))
        batch = len(self.running) + 1
        ctx = sum(r.ctx for r in self.running) + call.prompt_tokens
        return self.cost.service_s(m, call.prompt_tokens, call.output_tokens, cached, batch, ctx)

    def estimate_batch_s(self, calls: Sequence[Call]) -> float:
        """Seconds of one model's `calls` run together on their own (`CostModel.batch_s`)."""
        def cached(c: Call) -> int:
            loc = self.cached_prefix(c.session, c.model)
            return min(c.max_prefix_tokens, max(loc.device_tokens, loc.host_tokens))
        return self.cost.batch_s(self.shapes[calls[0].model], [(c.prompt_tokens, c.output_tokens, cached(c))
                                                               for c in calls]) if calls else 0.0

    # --- InstanceAPI: actions ---------------------------------------------------------------
    def admit(self, call: Call) -> None:
        if call.model not in self.weights:
            raise ValueError(f"instance {self.name} does not host model {call.model!r}")
        self.waiting.append(_Req(call, 0, call.output_tokens, self.now))
        self._flight_pages += self.pages_for(call.model, call.context_after)
        e = self.kv_dev.get((call.session, call.model))
        if e is not None:
            e.in_use = True  # its prefix must survive until the prefill reads it
        self._touch()

    def abort(self, call: Call) -> bool:
        for k, r in enumerate(self.waiting):
            if r.call.key == call.key:
                del self.waiting[k]
                self._flight_pages -= self.pages_for(call.model, call.context_after)
                e = self.kv_dev.get((call.session, call.model))
                if e is not None:
                    e.in_use = False
                self._touch()
                return True
        return False

    def switch_model(self, model: str, pause: bool = False) -> None:
        """Switches at the next chunk; with `pause`, the active model's running calls are paused (their
        KV kept on device) and resume when their model is active again (`Instance.switch_model`)."""
        if model not in self.weights:
            raise ValueError(f"instance {self.name} does not host model {model!r}")
        if self.waiting or (self.running and (not pause or self.drop_kv_on_switch)):
            why = ("admitted but not started" if self.waiting else "in flight (sleep mode)" if pause else
                   "in flight (pause=True pauses them)")
            raise RuntimeError(f"instance {self.name}: switch to {model} with calls {why}")
        if self.running:
            self.paused[self._active] = self.running
            self.running = []
            self.stats.pauses += 1
        self._switch_to = model

    def stage_model(self, model: str) -> bool:
        """Starts a background host-to-device copy of `model` into the staging area."""
        if not self.staging or model not in self.weights:
            return False
        s = self.weight_state(model)
        if s in _ON_DEVICE:
            return True
        if self._staging_model is not None:
            return False  # one staging area; it holds the model staged earlier
        # Staging pays for itself: it evicts only what costs less to bring back than the switch time it
        # saves (a PCIe load against a D2D copy), never protected KV, and never the active model's idle
        # KV (its sessions return within its slot, before the staged model is needed).
        m = self.shapes[model]
        saved_s = self.cost.weight_load_s(m) - self.cost.d2d_weights_s(m)
        if not self._make_room(m.weight_bytes, allow_protected=False, keep_model=self._active, budget_s=saved_s):
            return False
        self._set_weight(model, WeightState.STAGING)
        self._staging_model, self._staging_start = model, self.now
        self._check_capacity()
        return True

    def cut_kv(self, session_id: str, tokens: int, keep_model: str | None = None) -> None:
        """A call of the session compacted its context to a prefix of `tokens`: the session's KV held
        here beyond it (device and host, every model but `keep_model`, whose KV that call wrote) is
        stale for every later call, as a real instance's token history is cut (``SessionTokens``)."""
        for m in self._models:
            if m == keep_model:
                continue
            e = self.kv_dev.get((session_id, m))
            if e is not None and e.tokens > tokens:
                self._set_kv_tokens(e, tokens)
            h = self.kv_host.get((session_id, m))
            if h is not None and h[1] > tokens:
                self._host_bytes -= (h[1] - tokens) * self._kv_bytes_per_token[m]
                self.kv_host[(session_id, m)] = (m, tokens)

    def protect_kv(self, session_id: str, until_s: float) -> None:
        """Protects the session's KV of its last call here (the model it is expected back on)."""
        mine = self._session_kv(session_id)
        if mine:
            key, e = max(mine, key=lambda ke: ke[1].last_used)
            e.protect_until = until_s
            self._protected_sids[key] = None
            self._touch()

    # --- memory management ------------------------------------------------------------------
    def _update_staging(self, now: float) -> None:
        m = self._staging_model
        if m is not None and self.weights[m] == WeightState.STAGING:
            if now >= self._staging_start + self.cost.weight_load_s(self.shapes[m]) - 1e-12:
                self._set_weight(m, WeightState.STAGED)

    def _staging_stretch_s(self, start: float, work_s: float) -> float:
        """Wall seconds of `work_s` seconds of engine step work (prefill or decode) begun at `start`,
        while a staging copy may be in flight: the copy competes with the step for the device's
        cores and memory bandwidth (on a CPU; a GPU's copy engine does not), so work runs
        ``staging_step_slowdown`` (f) times slower until the copy arrives, and at full speed after.
        A chunk that outlasts the copy is charged proportionally: the part of it before the copy's
        arrival at f, the rest at 1. The copy's own duration stays `weight_load_s` (its slowdown
        by the step is not modelled). With f = 1, or no copy in flight, this is `work_s`."""
        return self._stretch(self._stretch_window(start), work_s)

    def _stretch_window(self, start: float) -> float | None:
        """Wall seconds after `start` during which steps run slowed by a staging copy (None: none)."""
        m = self._staging_model
        if self.hw.staging_step_slowdown == 1.0 or m is None or self.weights[m] != WeightState.STAGING:
            return None
        return max(0.0, self._staging_start + self.cost.weight_load_s(self.shapes[m]) - start)

    def _stretch(self, slow: float | None, work_s: float) -> float:
        """`_staging_stretch_s` given the slowed window `slow` from `_stretch_window`."""
        f = self.hw.staging_step_slowdown
        if slow is None or work_s <= 0.0:
            return work_s
        if work_s * f <= slow:
            return work_s * f
        return slow + (work_s - slow / f)

    def _check_capacity(self) -> None:
        used = self.device_bytes()
        if used > self.capacity + 1.0:
            raise AssertionError(f"instance {self.name}: HBM {used / 1e9:.1f} GB > usable {self.capacity / 1e9:.1f} GB")
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, used)
        self.stats.peak_kv_pages = max(self.stats.peak_kv_pages, self._kv_dev_pages())

    def _drop_dev_kv(self, key: tuple[str, str]) -> None:
        e = self.kv_dev.pop(key)  # host copies are written through at call end, so nothing is lost
        self._dev_pages -= self.pages_for(e.model, e.tokens)
        self._touch()

    def _kv_refill_s_per_byte(self, key: tuple[str, str], e: _DevKV) -> float:
        """Seconds per byte to bring idle device KV back once dropped: a host restore when a host
        copy holds all of it, else a recompute (prefill of its tokens) when its session returns."""
        m = self.shapes[e.model]
        h = self.kv_host.get(key)
        if self.host_kv and h is not None and h[1] >= e.tokens:
            secs = self.cost.h2d_kv_s(m, e.tokens)
        else:
            secs = self.cost.prefill_s(m, e.tokens, 0)
        return secs / max(1.0, e.tokens * m.kv_bytes_per_token)

    def _make_room(self, need: float, allow_protected: bool = True, keep_model: str | None = None,
                   budget_s: float = math.inf) -> bool:
        """Evicts until `need` bytes are free. Unprotected idle KV and inactive resident weights go
        first, cheapest to bring back per byte freed first (least recently used among equals): KV
        with a host copy (a PCIe restore), then weights (a PCIe load), then KV without a host copy
        (a recompute). Protected idle KV goes last (soonest to lapse first), and only if allowed.
        Idle KV of `keep_model` is never evicted. With a finite `budget_s`, nothing is evicted unless
        the unprotected victims free `need` for at most that many seconds of bringing them back."""
        def free() -> float:
            return self.capacity - self.device_bytes()
        if free() >= need:
            return True
        sig = lambda x: float(f"{x:.9g}")  # equal rates must tie exactly so that LRU decides
        victims = [(sig(self._kv_refill_s_per_byte(key, e)), e.last_used, 0, key) for key, e in self.kv_dev.items()
                   if not e.in_use and e.protect_until <= self.now and e.model != keep_model]
        victims += [(sig(self.cost.weight_load_s(self.shapes[m]) / self.shapes[m].weight_bytes),
                     self._weights_lru.get(m, 0.0), 1, m) for m, s in self.weights.items() if s == WeightState.RESIDENT]
        victims.sort()
        if budget_s < math.inf:
            short, cost = need - free(), 0.0
            for k, (rate, _, kind, key) in enumerate(victims):
                freed = self.pages_for(self.kv_dev[key].model, self.kv_dev[key].tokens) * self.page_bytes \
                    if kind == 0 else self.shapes[key].weight_bytes
                short, cost = short - freed, cost + rate * freed
                if short <= 0:
                    break
            if short > 0 or cost > budget_s:
                return False
            victims = victims[:k + 1]
        for _, _, kind, key in victims:
            if kind == 0:
                self._drop_dev_kv(key)
            else:
                self._set_weight(key, WeightState.HOST)
            if free() >= need:
                return True
        if allow_protected:
            prot = sorted((e.protect_until, key) for key, e in self.kv_dev.items() if not e.in_use)
            for _, key in prot:
                self._drop_dev_kv(key)
                if free() >= need:
                    return True
        return free() >= need

    def _drop_staged(self, need: float) -> bool:
        """Gives up the staging area's model (its copy cancelled, or its staged weights dropped) when a
        switch to another model finds no room beside it; whether `need` bytes are then free."""
        m = self._staging_model
        if m is None or self.weights[m] not in (WeightState.STAGING, WeightState.STAGED):
            return False
        self._set_weight(m, WeightState.HOST)
        self._staging_model = None
        return self._make_room(need)

    def _host_store(self, sid: str, model: str, tokens: int) -> None:
        kvb = lambda v: v[1] * self._kv_bytes_per_token[v[0]]
        key = (sid, model)
        old = self.kv_host.get(key)
        if old is not None:
            self._host_bytes -= kvb(old)
        self.kv_host[key] = (model, tokens)
        self.kv_host.move_to_end(key)
        self._host_bytes += kvb((model, tokens))  # a running total (integers: KV bytes per token are)
        while self._host_bytes > self.host_kv_capacity and self.kv_host:
            _, v = self.kv_host.popitem(last=False)
            self._host_bytes -= kvb(v)

    # --- chunks -----------------------------------------------------------------------------
    def _jitter(self) -> float:
        return float(np.exp(self.rng.normal(0.0, self.jitter_sigma))) if self.jitter_sigma > 0 else 1.0

    def start_chunk(self, now: float, horizon: float | None = None) -> float | None:
        """Starts the next chunk at `now`; returns when it ends, or None when there is no work.
        A decode chunk stops at the first step that reaches `horizon` (at most the event loop's
        longest chunk; ``truncate_chunk`` cuts it shorter when an arrival needs planning sooner)."""
        assert self.busy_until is None, "start_chunk while busy"
        self.now = now
        self._update_staging(now)
        end = self._start_chunk(now, horizon)
        if end is not None:
            self.stats.chunks += 1
        return end

    def _start_chunk(self, now: float, horizon: float | None) -> float | None:
        if self._switch_to is not None:
            dur = self._start_switch(self._switch_to)
            self.chunk = Switch(self._switch_to)
            self._switch_to = None
            return self._busy(now, dur)
        if self.waiting:
            dur = self._start_prefill()
            if dur is not None:
                return self._busy(now, dur)
        if self.running:
            return self._busy(now, self._start_decode(now, horizon))
        if self.waiting:
            c = self.waiting[0].call
            raise CapacityError(f"instance {self.name}: call {c.key} needs {self.pages_for(c.model, c.context_after)} "
                                f"KV pages, more than the {self.kv_pages_total()} the instance can free")
        return None

    def _busy(self, now: float, dur: float) -> float:
        self.busy_until = now + dur
        return self.busy_until

    def _start_switch(self, model: str) -> float:
        m = self.shapes[model]
        old = self._active
        if old is not None:
            self._set_weight(old, WeightState.RESIDENT)
            self._weights_lru[old] = self.now
            if self.drop_kv_on_switch:  # sleep mode level 1 discards the KV cache
                for key in [k for k, e in self.kv_dev.items() if e.model == old]:
                    self._drop_dev_kv(key)
        self._active = None
        s = self.weights[model]
        if s == WeightState.RESIDENT:
            dur = 0.0
        elif s == WeightState.STAGED:
            dur = self.cost.d2d_weights_s(m)
        elif s == WeightState.STAGING:
            dur = self.estimate_switch_s(model)
        else:
            if not self._make_room(m.weight_bytes) and not self._drop_staged(m.weight_bytes):
                raise CapacityError(f"instance {self.name}: weights of {model} ({m.weights_gb} GB) do not fit "
                                    f"the usable HBM {self.capacity / 1e9:.1f} GB")
            dur = self.cost.weight_load_s(m)
        if self._staging_model == model:
            self._staging_model = None
        self._set_weight(model, WeightState.ACTIVE)
        self._check_capacity()
        dur *= self._jitter()
        self.stats.switches += 1
        self.stats.switch_s += dur
        self.stats.switch_log.append((self.now, model, dur))
        return dur

    def _start_prefill(self) -> float | None:
        model = self._active
        m = self.shapes[model]
        batch, keep, chunks, restore_s = [], [], [], 0.0
        for r in self.waiting:
            c = r.call
            if c.model != model:
                raise RuntimeError(f"instance {self.name}: call {c.key} for {c.model} admitted while {model} is active")
            e = self.kv_dev.get((c.session, model))
            # cached KV serves the call's reusable prefix at most: after a compaction (prefix_tokens) the
            # rest of the prompt is new, and the session's older KV beyond the prefix is overwritten
            limit = c.max_prefix_tokens
            cached = min(e.tokens, limit) if e is not None else 0
            h = self.kv_host.get((c.session, model))
            restore = 0
            if self.host_kv and h is not None:
                restore = max(0, min(h[1], limit) - cached)
            need = (self.pages_for(model, c.context_after) - (self.pages_for(model, e.tokens) if e else 0)) * self.page_bytes
            if e is not None:
                e.in_use = True
                self._touch()
            if not self._make_room(need):
                keep.append(r)
                continue
            if e is None:
                e = self.kv_dev[(c.session, model)] = _DevKV(model, 0, self.now, in_use=True)
            self._set_kv_tokens(e, c.context_after)
            e.last_used = self.now
            new = c.prompt_tokens - cached - restore
            reusable = self.reusable_prefix(c) if self.reusable_prefix is not None else 0
            self.stats.device_hit_tokens += cached
            self.stats.restored_tokens += restore
            self.stats.recomputed_tokens += max(0, min(reusable, c.prompt_tokens) - cached - restore)
            self.stats.prefill_tokens += new
            t_restore = self.cost.h2d_kv_s(m, restore)
            if self._staging_model is not None and self.weights[self._staging_model] == WeightState.STAGING:
                self._staging_start += t_restore  # KV restore and weight staging share the PCIe link
            restore_s += t_restore
            chunks.append((new, cached + restore))
            r.ctx = c.prompt_tokens
            batch.append(r)
        self._check_capacity()
        if not batch:
            return None
        self.waiting = keep
        self._touch()
        self.chunk = Prefill(tuple(batch))
        # the restores go first (the staging copy waits for them: _staging_start moved by as much),
        # then one prefill step over the batch (one weight read), slowed while the copy is in flight
        dur = restore_s + self._staging_stretch_s(self.now + restore_s, self.cost.prefill_batch_s(m, chunks))
        return dur * self._jitter()

    def _start_decode(self, now: float, horizon: float | None) -> float:
        m = self.shapes[self._active]
        b = len(self.running)
        ctx = sum(r.ctx for r in self.running)
        kmax = min(r.remaining for r in self.running)
        slow = self._stretch_window(now)
        step0 = self._stretch(slow, self.cost.decode_step_s(m, b, ctx))
        k = kmax
        if horizon is not None and step0 > 0:
            k = max(1, min(kmax, math.ceil((horizon - now) / step0)))
        self.chunk = Decode(k, now, m, b, ctx, step0, slow, self._jitter())
        return self._decode_s(self.chunk, k)

    def _decode_s(self, d: Decode, k: int) -> float:
        """Seconds of the decode chunk `d` if it ran `k` steps."""
        return self._stretch(d.slow, self.cost.decode_run_s(d.shape, d.batch, d.ctx, k)) * d.jitter

    def truncate_chunk(self, t: float) -> float | None:
        """Cuts the decode chunk in flight short at the first step boundary at or after `t` (an
        arrival routed here while it runs): it then runs the steps it would have run had it been
        started with `t` as its horizon. Returns its new end, or None when nothing changed (no decode
        chunk in flight, or it ends in the step that covers `t` anyway)."""
        d = self.chunk
        if self.busy_until is None or not isinstance(d, Decode) or t >= self.busy_until or d.step0 <= 0:
            return None
        k = d.steps
        k2 = max(1, math.ceil((t - d.start) / d.step0))
        while k2 < k:
            end = d.start + self._decode_s(d, k2)
            if end >= t:  # (kernel jitter can end k2 steps before t; it then runs one step more)
                break
            k2 += 1
        if k2 >= k:
            return None
        self.chunk = dataclasses.replace(d, steps=k2)
        self.busy_until = end
        self.stats.truncated_chunks += 1
        return end

    def finish_chunk(self, now: float) -> list[Call]:
        """Applies the chunk that ends at `now`; returns the calls that completed."""
        assert self.busy_until is not None and abs(now - self.busy_until) < 1e-9, "finish_chunk at wrong time"
        self.now, self.busy_until = now, None
        chunk, self.chunk = self.chunk, None
        done: list[Call] = []
        if isinstance(chunk, Switch):
            self._active = chunk.model
            self._weights_lru[chunk.model] = now
            self.running.extend(self.paused.pop(chunk.model, []))  # its paused calls resume
        elif isinstance(chunk, Prefill):
            self.running.extend(chunk.batch)
        elif isinstance(chunk, Decode):
            still = []
            for r in self.running:
                r.ctx += chunk.steps
                r.remaining -= chunk.steps
                if r.remaining > 0:
                    still.append(r)
                    continue
                c = r.call
                e = self.kv_dev[(c.session, c.model)]
                e.in_use, e.last_used = False, now
                self._set_kv_tokens(e, c.context_after)
                self._flight_pages -= self.pages_for(c.model, c.context_after)
                if self.host_kv:
                    # write-through of the new tokens only (~1K tokens, about a millisecond over PCIe),
                    # overlapped with decode on the otherwise idle device-to-host direction
                    self._host_store(c.session, c.model, c.context_after)
                done.append(c)
            self.running = still
        self._update_staging(now)
        return done
