"""A per-session lower bound on completion time that no scheduling policy can beat.

A session's floor is its tool time plus the time its calls would take if each ran alone on an idle
instance with its model already active and its whole reusable prefix (the earlier context, or the
``prefix_tokens`` a compacting turn keeps) cached on device: each call
prefills only its new tokens and decodes at batch 1 from its prompt's context. Every term is the
cost model's own minimum (a decode step costs at least the batch-1 step at the call's starting
context, a prefill at least its new tokens over the longest cache), so with kernel jitter off
``sct >= floor`` holds for every session under every policy, and any quantile of the floors bounds
the same quantile of the SCTs. ``round p50 / floor p50`` is then the largest p50 speed-up over
round that any scheduler could show on that trace.
"""
from __future__ import annotations

from typing import Iterable

from talaria_jax.scheduler.session import Call, reusable_prefixes
from talaria_jax.sim.cost import CostModel


def service_floor_s(calls: Iterable[Call], cost: CostModel, shapes: dict) -> dict[str, float]:
    """Seconds of GPU time each session needs at the least (no wait, no switch, no recompute)."""
    out: dict[str, float] = {}
    by: dict[str, list[Call]] = {}
    for c in sorted(calls, key=lambda c: (c.session, c.turn)):
        by.setdefault(c.session, []).append(c)
    for sid, cs in by.items():
        cached = reusable_prefixes(cs)
        out[sid] = sum(cost.prefill_s(shapes[c.model], c.prompt_tokens - cached[c.key], cached[c.key])
                       + c.output_tokens * cost.decode_step_s(shapes[c.model], 1, c.prompt_tokens) for c in cs)
    return out


def sct_floor_s(calls: Iterable[Call], cost: CostModel, shapes: dict, tool_s: dict[str, float]) -> dict[str, float]:
    """Per session: the service floor plus the tool time it saw in the replay (``ReplayResult.tool_s``)."""
    return {sid: t + tool_s[sid] for sid, t in service_floor_s(calls, cost, shapes).items()}
