"""Placement of a call on an instance: one score per (call, instance), highest wins.

talaria score (weights in ``RouterWeights``):
    residency * exp(-switch_s / switch_scale_s)
  + locality  * min(1, (device_tokens + host_factor * host_tokens) / prompt_tokens)
  - pressure  * ((running + waiting + routed_not_admitted) / queue_ref + kv_utilisation)
kv_utilisation = (pages used + pages of idle KV protected for *other* sessions' returns) / pages.
where switch_s is the instance's own estimate of switching to the call's model (0 when active).
Ties break by instance order, so ranking is deterministic.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from talaria_jax.scheduler.api import InstanceAPI, PrefixLocation
from talaria_jax.scheduler.policies import PolicyConfig
from talaria_jax.scheduler.session import Call, Session


def kv_utilisation(inst: InstanceAPI, session: str | None = None) -> float:
    """Share of the instance's KV pages used or kept for other sessions' likely returns (the
    placed call's own session's protected KV is what it will reuse, so it does not count)."""
    total = inst.kv_pages_total()
    return 1.0 if total <= 0 else (inst.kv_pages_used() + inst.kv_pages_reserved(session)) / total


def queue_len(inst: InstanceAPI, routed: int) -> int:
    return inst.num_running() + inst.num_waiting() + routed


def usable_prefix(call: Call, inst: InstanceAPI) -> PrefixLocation:
    """The session's cached prefix on `inst`, up to what the call can reuse (a compacted turn states
    ``prefix_tokens``: KV beyond it is stale)."""
    loc = inst.cached_prefix(call.session, call.model)
    cap = call.max_prefix_tokens
    return PrefixLocation(min(loc.device_tokens, cap), min(loc.host_tokens, cap))


def talaria_score(policy: PolicyConfig, call: Call, inst: InstanceAPI, routed: int) -> float:
    w = policy.weights
    residency = math.exp(-inst.estimate_switch_s(call.model) / w.switch_scale_s)
    loc = usable_prefix(call, inst)
    host = loc.host_tokens if policy.host_kv else 0
    locality = min(1.0, (loc.device_tokens + w.host_factor * max(0, host - loc.device_tokens)) / max(1, call.prompt_tokens))
    pressure = queue_len(inst, routed) / w.queue_ref + kv_utilisation(inst, call.session)
    return w.residency * residency + w.locality * locality - w.pressure * pressure


def kv_aware_score(policy: PolicyConfig, call: Call, inst: InstanceAPI, routed: int) -> float:
    """llm-d's scorer (docs/references.md: 3 prefix + 2 queue + 2 KV utilisation); blind to residency."""
    loc = usable_prefix(call, inst)
    prefix = min(1.0, max(loc.device_tokens, loc.host_tokens if policy.host_kv else 0) / max(1, call.prompt_tokens))
    queue = min(1.0, queue_len(inst, routed) / policy.weights.queue_ref)
    return 3.0 * prefix + 2.0 * (1.0 - queue) + 2.0 * (1.0 - kv_utilisation(inst, call.session))


def rank(policy: PolicyConfig, call: Call, session: Session, instances: Sequence[InstanceAPI],
         routed: dict[str, int]) -> list[InstanceAPI]:
    """Instances able to host call.model, best first under the policy's router."""
    cands = [i for i in instances if call.model in i.models()]
    if not cands:
        raise ValueError(f"no instance hosts model {call.model!r} (call {call.key})")
    order = {i.name: k for k, i in enumerate(cands)}
    if policy.router == "talaria":
        key = lambda i: (-talaria_score(policy, call, i, routed.get(i.name, 0)), order[i.name])
    elif policy.router == "kv":
        key = lambda i: (-kv_aware_score(policy, call, i, routed.get(i.name, 0)), order[i.name])
    elif policy.router in ("load", "sticky"):
        key = lambda i: (queue_len(i, routed.get(i.name, 0)), order[i.name])
    else:  # PolicyConfig validates the name; this guards a future one
        raise ValueError(f"router {policy.router!r}")
    ranked = sorted(cands, key=key)
    if policy.router == "sticky" and session.last_instance is not None:
        sticky = [i for i in cands if i.name == session.last_instance]
        ranked = sticky + [i for i in ranked if i.name != session.last_instance]
    return ranked


class RouteIndex:
    """`rank(...)[0]` over many instances at once, for an event loop that re-plans an instance after
    every change to it (``talaria_jax.sim.cluster.run``).

    It keeps each instance's call-independent routing figures in arrays (queue length, KV pages used,
    protected and total, and each model's residency term) and refreshes an instance's row only when
    the scheduler touched it (``touch``: planned, a call finished or was routed there) or when the
    instance said its figures change with time (``routing_valid_until``: a staging copy in flight, a
    KV protection lapsing). A call's own session only weighs on the instances it was routed to
    before (its locality and its own protected KV are there): those are scored exactly, one by one,
    and every other instance by the arrays, with the same float operations as the scalar scores.
    So the winner is the same instance as `rank`'s, ties included (first in instance order).

    Instances must implement ``routing_valid_until(now)``, and a session's prefix may be cached only
    on instances its calls were admitted to (true of ``SimInstance``, not of a real instance whose
    prefix cache is shared across sessions).
    """

    def __init__(self, policy: PolicyConfig, instances: Sequence[InstanceAPI], routed: Callable[[str], int]):
        import numpy as np  # here, so the rest of the scheduler stays standard-library only

        self.np = np
        self.policy = policy
        self.insts = list(instances)
        self.pos = {inst.name: k for k, inst in enumerate(self.insts)}
        self.routed = routed  # instance name -> calls routed there and not admitted yet
        models = sorted({m for inst in self.insts for m in inst.models()})
        self.col = {m: k for k, m in enumerate(models)}
        n = len(self.insts)
        self.hosts = np.zeros((n, len(models)), bool)
        for k, inst in enumerate(self.insts):
            for m in inst.models():
                self.hosts[k, self.col[m]] = True
        self.residency = np.zeros((n, len(models)))  # exp(-switch_s / switch_scale_s)
        self.queue = np.zeros(n, np.int64)  # running + waiting + routed
        self.used = np.zeros(n, np.int64)
        self.reserved = np.zeros(n, np.int64)  # protected idle KV of any session
        self.total = np.zeros(n, np.int64)
        self.valid_until = np.full(n, -np.inf)  # refresh every row at the first placement
        self.weights_seen: list = [None] * n  # the instance's weights_version when its residency was computed
        self.dirty: set[int] = set()
        self.seen: dict[str, dict[int, None]] = {}  # session -> instances its calls were routed to

    def touch(self, inst: InstanceAPI) -> None:
        self.dirty.add(self.pos[inst.name])

    def _refresh(self, k: int, now: float) -> None:
        inst = self.insts[k]
        inst.now = now  # the loop's clock: the figures are read at the placement's time
        if self.policy.router == "talaria":
            # an instance with a `weights_version` (None while it cannot vouch) recomputes its
            # switch estimates only when its weights changed
            v = getattr(inst, "weights_version", None)
            if v is None or v != self.weights_seen[k]:
                scale = self.policy.weights.switch_scale_s
                for m in inst.models():
                    self.residency[k, self.col[m]] = math.exp(-inst.estimate_switch_s(m) / scale)
                self.weights_seen[k] = v
        self.queue[k] = inst.num_running() + inst.num_waiting() + self.routed(inst.name)
        self.used[k] = inst.kv_pages_used()
        self.reserved[k] = inst.kv_pages_reserved()
        self.total[k] = inst.kv_pages_total()
        self.valid_until[k] = inst.routing_valid_until(now)

    def best(self, call: Call, session: Session, now: float) -> InstanceAPI:
        np, p, w = self.np, self.policy, self.policy.weights
        stale = self.dirty.union(np.flatnonzero(self.valid_until <= now).tolist())
        for k in stale:
            self._refresh(k, now)
        self.dirty.clear()
        col = self.col.get(call.model)
        if col is None or not self.hosts[:, col].any():
            raise ValueError(f"no instance hosts model {call.model!r} (call {call.key})")
        mask = self.hosts[:, col]
        if p.router in ("load", "sticky"):
            if p.router == "sticky" and session.last_instance in self.pos and mask[self.pos[session.last_instance]]:
                return self.insts[self.pos[session.last_instance]]
            return self.insts[int(np.argmin(np.where(mask, self.queue, np.iinfo(np.int64).max)))]
        with np.errstate(divide="ignore", invalid="ignore"):
            util = np.where(self.total > 0, (self.used + self.reserved) / self.total, 1.0)
        if p.router == "talaria":
            score = (w.residency * self.residency[:, col] + 0.0) - w.pressure * (self.queue / w.queue_ref + util)
        elif p.router == "kv":
            score = (0.0 + 2.0 * (1.0 - np.minimum(1.0, self.queue / w.queue_ref))) + 2.0 * (1.0 - util)
        else:
            raise ValueError(f"router {p.router!r}")
        for k in self.seen.get(call.session, ()):
            if mask[k]:  # the session's own KV: its locality, and its protected KV is not pressure
                inst = self.insts[k]
                inst.now = now
                routed = self.routed(inst.name)
                score[k] = (talaria_score if p.router == "talaria" else kv_aware_score)(p, call, inst, routed)
        score[~mask] = -np.inf
        return self.insts[int(np.argmax(score))]

    def routed_to(self, call: Call, inst: InstanceAPI) -> None:
        """Records that `call` was routed to `inst` (its session's prefix may be cached there from now on)."""
        k = self.pos[inst.name]
        self.seen.setdefault(call.session, {})[k] = None
        self.dirty.add(k)
