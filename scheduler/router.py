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
from typing import Sequence

from talaria_jax.scheduler.api import InstanceAPI
from talaria_jax.scheduler.policies import PolicyConfig
from talaria_jax.scheduler.session import Call, Session


def kv_utilisation(inst: InstanceAPI, session: str | None = None) -> float:
    """Share of the instance's KV pages used or kept for other sessions' likely returns (the
    placed call's own session's protected KV is what it will reuse, so it does not count)."""
    total = inst.kv_pages_total()
    return 1.0 if total <= 0 else (inst.kv_pages_used() + inst.kv_pages_reserved(session)) / total


def queue_len(inst: InstanceAPI, routed: int) -> int:
    return inst.num_running() + inst.num_waiting() + routed


def talaria_score(policy: PolicyConfig, call: Call, inst: InstanceAPI, routed: int) -> float:
    w = policy.weights
    residency = math.exp(-inst.estimate_switch_s(call.model) / w.switch_scale_s)
    loc = inst.cached_prefix(call.session, call.model)
    host = loc.host_tokens if policy.host_kv else 0
    locality = min(1.0, (loc.device_tokens + w.host_factor * max(0, host - loc.device_tokens)) / max(1, call.prompt_tokens))
    pressure = queue_len(inst, routed) / w.queue_ref + kv_utilisation(inst, call.session)
    return w.residency * residency + w.locality * locality - w.pressure * pressure


def kv_aware_score(policy: PolicyConfig, call: Call, inst: InstanceAPI, routed: int) -> float:
    """llm-d's scorer (REFERENCES.md: 3 prefix + 2 queue + 2 KV utilisation); blind to residency."""
    loc = inst.cached_prefix(call.session, call.model)
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
