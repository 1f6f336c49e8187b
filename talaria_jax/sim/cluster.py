"""Discrete-event replay of a trace through the scheduler over simulated instances.

A session's first call is issued at its start_s and each next call tool_gap_s after the previous
one completes. Every instance between chunks is planned by the scheduler, then starts its next
chunk; decode chunks stop at the next outside event (or after max_chunk_s) so arrivals are
admitted within one decode step of when they would be on a real engine.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence

import numpy as np

from talaria_jax.scheduler import PolicyConfig, Scheduler, SessionTable
from talaria_jax.scheduler.session import Call
from talaria_jax.sim.hardware import HardwareConfig, ModelShape
from talaria_jax.sim.instance import SimInstance

_ARRIVAL, _READY, _WAKE = 0, 1, 2


@dataclasses.dataclass
class CallRecord:
    session: str
    turn: int
    instance: str
    issued_s: float
    done_s: float
    model: str = ""


@dataclasses.dataclass
class ReplayResult:
    policy: str
    seed: int
    sct_s: dict[str, float]  # session -> completion time (last call done - session start)
    tool_s: dict[str, float]  # session -> tool time it saw (its gaps times this seed's jitter)
    records: list[CallRecord]
    makespan_s: float
    instances: list  # SimInstance, or talaria_jax.instance.Instance

    def summary(self) -> dict:
        sct = np.array(sorted(self.sct_s.values()))
        st = [i.stats for i in self.instances]
        return {
            "sct_p50_s": float(np.quantile(sct, 0.5)), "sct_p95_s": float(np.quantile(sct, 0.95)),
            "sct_mean_s": float(sct.mean()), "calls": len(self.records),
            "calls_per_s": len(self.records) / self.makespan_s if self.makespan_s > 0 else 0.0,
            "makespan_s": self.makespan_s,
            "model_switches": sum(s.switches for s in st), "switch_time_s": sum(s.switch_s for s in st),
            "kv_restored_tokens": sum(s.restored_tokens for s in st),
            "kv_recomputed_tokens": sum(s.recomputed_tokens for s in st),
            "kv_device_hit_tokens": sum(s.device_hit_tokens for s in st),
            "prefill_tokens": sum(s.prefill_tokens for s in st),
            "peak_hbm_fraction": max(s.peak_device_bytes / i.capacity for s, i in zip(st, self.instances)),
        }


def tool_gap_factors(calls: Sequence[Call], seed: int, sigma: float) -> dict[tuple[str, int], float]:
    """Tool-time jitter, drawn per call in trace order before the replay: every policy replayed with
    the same seed sees the same tool time after each call (common random numbers), so policy
    differences are not draws assigned by completion order."""
    if not sigma:
        return {}
    rng = np.random.default_rng(seed)
    return dict(zip((c.key for c in calls), np.exp(rng.normal(0.0, sigma, len(calls))).tolist()))


def session_tool_s(calls: Sequence[Call], factors: dict[tuple[str, int], float]) -> dict[str, float]:
    """Per session, the tool time between its calls (the last call's gap is never waited)."""
    last: dict[str, int] = {}
    for c in calls:
        last[c.session] = max(last.get(c.session, 0), c.turn)
    out = {c.session: 0.0 for c in calls}
    for c in calls:
        if c.turn != last[c.session]:
            out[c.session] += c.tool_gap_s * factors.get(c.key, 1.0)
    return out


def replay(calls: Sequence[Call], policy: PolicyConfig, hw: HardwareConfig, shapes: dict[str, ModelShape], *,
           servers: int = 1, seed: int = 0, jitter_sigma: float = 0.05, gap_jitter_sigma: float = 0.1,
           max_chunk_s: float = 0.25, page_bytes: int = 4 * 2**20) -> ReplayResult:
    """Replays `calls` under `policy` on `servers` instances of `hw`, each able to host every model
    of the trace. `seed` drives run-to-run variance: kernel-time jitter (lognormal jitter_sigma per
    chunk) and tool-time jitter (lognormal gap_jitter_sigma per gap); the trace itself is fixed."""
    if servers < 1:
        raise ValueError(f"servers={servers} must be >= 1")
    models = tuple(dict.fromkeys(c.model for c in calls))
    missing = [m for m in models if m not in shapes]
    if missing:
        raise ValueError(f"trace models {missing} have no shape in the models table (known: {sorted(shapes)})")
    sessions = SessionTable(list(calls))
    prefix = {}
    for s in sessions:
        for a, b in zip(s.calls, s.calls[1:]):
            prefix[b.key] = b.reusable_prefix(a.context_after)
    gap_factor = tool_gap_factors(calls, seed, gap_jitter_sigma)
    insts = [SimInstance(f"i{k}", hw, shapes, models, host_kv=policy.host_kv, staging=policy.staging,
                         drop_kv_on_switch=policy.drop_kv_on_switch, page_bytes=page_bytes,
                         reusable_prefix=lambda c: prefix.get(c.key, 0),
                         jitter_sigma=jitter_sigma, rng=np.random.default_rng([seed, k]))
             for k in range(servers)]
    return run(calls, policy, insts, sessions, seed, gap_factor, max_chunk_s)


def run(calls: Sequence[Call], policy: PolicyConfig, insts: Sequence, sessions: SessionTable, seed: int,
        gap_factor: dict[tuple[str, int], float], max_chunk_s: float = 0.25) -> ReplayResult:
    """The event loop over any instances with SimInstance's chunk interface (`start_chunk`,
    `finish_chunk`, `is_busy`, `now`): simulated ones, or real ones (``talaria_jax.instance``) whose
    chunks run for real and report their measured seconds."""
    sched = Scheduler(policy, insts, sessions)
    heap: list = []
    seq = itertools.count()
    for s in sessions:
        heapq.heappush(heap, (s.calls[0].start_s, next(seq), _ARRIVAL, s.calls[0]))
        s.arrived_s = s.calls[0].start_s
    issued: dict[tuple[str, int], float] = {}
    records: list[CallRecord] = []
    wake_at: dict[str, float] = {}
    now = 0.0
    while heap:
        now, _, kind, obj = heapq.heappop(heap)
        if kind == _ARRIVAL:
            issued[obj.key] = now
            sched.on_arrival(obj, now)
        elif kind == _READY:
            inst = obj
            for c in inst.finish_chunk(now):
                records.append(CallRecord(c.session, c.turn, inst.name, issued[c.key], now, c.model))
                nxt = sessions.complete(c, inst.name, now)
                sched.on_finish(c, inst, now)
                if nxt is not None:
                    gap = c.tool_gap_s * gap_factor.get(c.key, 1.0)
                    heapq.heappush(heap, (now + gap, next(seq), _ARRIVAL, nxt))
        # _WAKE carries nothing: it only makes the planning below run at that time
        for inst in insts:
            inst.now = now
        for inst in insts:
            if inst.is_busy():
                continue
            wake = sched.plan(inst, now)
            horizon = min(heap[0][0] if heap else now + max_chunk_s, now + max_chunk_s)
            end = inst.start_chunk(now, horizon)
            if end is not None:
                heapq.heappush(heap, (end, next(seq), _READY, inst))
            elif wake is not None and wake > now and wake_at.get(inst.name) != wake:
                wake_at[inst.name] = wake
                heapq.heappush(heap, (wake, next(seq), _WAKE, None))
    unfinished = [s.id for s in sessions if not s.done]
    if unfinished:
        raise RuntimeError(f"policy {policy.name}: sessions never finished: {unfinished[:5]} (scheduler stalled)")
    sct = {s.id: s.finished_s - s.arrived_s for s in sessions}
    start = min(s.arrived_s for s in sessions)
    return ReplayResult(policy.name, seed, sct, session_tool_s(calls, gap_factor), records, now - start, list(insts))
