"""Discrete-event replay of a trace through the scheduler over simulated instances.

A session's first call is issued at its start_s and each next call tool_gap_s after the previous
one completes. An instance between chunks is planned by the scheduler, then starts its next chunk;
a decode chunk runs at most max_chunk_s and is cut short at the next step boundary when a call is
routed to its instance, so arrivals are admitted within one decode step of when they would be on a
real engine. Each instance is planned only on its own events (`run`), so a replay's cost grows with
its calls, not with calls times servers.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence

import numpy as np

from talaria_jax.scheduler import PolicyConfig, Scheduler, SessionTable
from talaria_jax.scheduler.session import Call, reusable_prefixes
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
            "pauses": sum(s.pauses for s in st),
            "compile_s": sum(s.compile_s for s in st),  # left out of a real instance's chunks (Instance.exclude_compiles)
            "kv_restored_tokens": sum(s.restored_tokens for s in st),
            "kv_recomputed_tokens": sum(s.recomputed_tokens for s in st),
            "kv_device_hit_tokens": sum(s.device_hit_tokens for s in st),
            "prefill_tokens": sum(s.prefill_tokens for s in st),
            "peak_hbm_fraction": max(s.peak_device_bytes / i.capacity for s, i in zip(st, self.instances)),
            # chunks each instance started (SimInstance counts them), per call
            "chunks_per_call": sum(getattr(s, "chunks", 0) for s in st) / max(1, len(self.records)),
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
           max_chunk_s: float = 0.25, page_bytes: int = 4 * 2**20, indexed: bool | None = None) -> ReplayResult:
    """Replays `calls` under `policy` on `servers` instances of `hw`, each able to host every model
    of the trace. `seed` drives run-to-run variance: kernel-time jitter (lognormal jitter_sigma per
    chunk) and tool-time jitter (lognormal gap_jitter_sigma per gap); the trace itself is fixed.
    `max_chunk_s` and `indexed`: as `run`."""
    if servers < 1:
        raise ValueError(f"servers={servers} must be >= 1")
    models = tuple(dict.fromkeys(c.model for c in calls))
    missing = [m for m in models if m not in shapes]
    if missing:
        raise ValueError(f"trace models {missing} have no shape in the models table (known: {sorted(shapes)})")
    sessions = SessionTable(list(calls))
    prefix = {k: t for s in sessions for k, t in reusable_prefixes(s.calls).items()}
    gap_factor = tool_gap_factors(calls, seed, gap_jitter_sigma)
    insts = [SimInstance(f"i{k}", hw, shapes, models, host_kv=policy.host_kv, staging=policy.staging,
                         drop_kv_on_switch=policy.drop_kv_on_switch, page_bytes=page_bytes,
                         reusable_prefix=lambda c: prefix.get(c.key, 0),
                         jitter_sigma=jitter_sigma, rng=np.random.default_rng([seed, k]))
             for k in range(servers)]
    return run(calls, policy, insts, sessions, seed, gap_factor, max_chunk_s, indexed)


def run(calls: Sequence[Call], policy: PolicyConfig, insts: Sequence, sessions: SessionTable, seed: int,
        gap_factor: dict[tuple[str, int], float], max_chunk_s: float = 0.25, indexed: bool | None = None) -> ReplayResult:
    """The event loop over any instances with SimInstance's chunk interface (`start_chunk`,
    `finish_chunk`, `is_busy`, `now`, and optionally `truncate_chunk` and `cut_kv`): simulated ones, or real ones
    (``talaria_jax.instance``) whose chunks run for real and report their measured seconds.

    One heap of events; each instance is planned only on its own events: its chunk's end, a wake it
    asked for, and an arrival routed to it (or one that released a reservation it holds) while it
    is idle. An arrival routed to an instance mid-decode cuts that chunk short at the step boundary
    at or after the arrival (``truncate_chunk``), as a real engine's next step would admit it; the
    superseded chunk end stays in the heap and is skipped by its chunk number.

    `indexed` (default: when every instance has ``routing_valid_until``, as SimInstance does) places
    calls through the scheduler's ``RouteIndex``: the same placements as ranking every instance at
    every arrival, at the cost of the instances changed since the last one."""
    if indexed is None:  # the loop below plans an instance after every change to it, as the index needs
        indexed = all(hasattr(inst, "routing_valid_until") for inst in insts)
    sched = Scheduler(policy, insts, sessions, indexed=indexed)
    index = {inst.name: k for k, inst in enumerate(insts)}
    truncate = [getattr(inst, "truncate_chunk", None) for inst in insts]
    heap: list = []
    seq = itertools.count()
    for s in sessions:
        heapq.heappush(heap, (s.calls[0].start_s, next(seq), _ARRIVAL, s.calls[0]))
        s.arrived_s = s.calls[0].start_s
    issued: dict[tuple[str, int], float] = {}
    records: list[CallRecord] = []
    chunk_no = [0] * len(insts)  # the chunk in flight on each instance; other _READY entries are stale
    wake_at: list[float | None] = [None] * len(insts)
    now = 0.0

    def plan(k: int) -> None:  # instance k is idle: plan it and start its next chunk
        inst = insts[k]
        inst.now = now
        wake = sched.plan(inst, now)
        end = inst.start_chunk(now, now + max_chunk_s)
        if end is not None:
            chunk_no[k] += 1
            heapq.heappush(heap, (end, next(seq), _READY, (k, chunk_no[k])))
        elif wake is not None and wake > now and wake_at[k] != wake:
            wake_at[k] = wake
            heapq.heappush(heap, (wake, next(seq), _WAKE, k))

    while heap:
        t, _, kind, obj = heapq.heappop(heap)
        if kind == _READY and obj[1] != chunk_no[obj[0]]:
            continue  # a chunk end superseded by a truncation
        now = t
        if kind == _ARRIVAL:
            issued[obj.key] = now
            if not indexed:
                for inst in insts:
                    inst.now = now  # the router reads every instance's state at this time
            k = index[sched.on_arrival(obj, now).name]
            if not insts[k].is_busy():
                plan(k)
            elif truncate[k] is not None:
                end = truncate[k](now)
                if end is not None:
                    chunk_no[k] += 1
                    heapq.heappush(heap, (end, next(seq), _READY, (k, chunk_no[k])))
            for inst in sched.released:
                j = index[inst.name]
                if not inst.is_busy():
                    plan(j)
        elif kind == _READY:
            k = obj[0]
            inst = insts[k]
            for c in inst.finish_chunk(now):
                records.append(CallRecord(c.session, c.turn, inst.name, issued[c.key], now, c.model))
                if c.prefix_tokens is not None:  # a compaction: the session's KV elsewhere is stale past it
                    for other in insts:
                        if hasattr(other, "cut_kv"):
                            other.cut_kv(c.session, c.prefix_tokens, c.model if other is inst else None)
                nxt = sessions.complete(c, inst.name, now)
                sched.on_finish(c, inst, now)
                if nxt is not None:
                    gap = c.tool_gap_s * gap_factor.get(c.key, 1.0)
                    heapq.heappush(heap, (now + gap, next(seq), _ARRIVAL, nxt))
            plan(k)
        elif not insts[obj].is_busy():  # _WAKE: a slot hold of an idle instance may end
            plan(obj)
    unfinished = [s.id for s in sessions if not s.done]
    if unfinished:
        raise RuntimeError(f"policy {policy.name}: sessions never finished: {unfinished[:5]} (scheduler stalled)")
    sct = {s.id: s.finished_s - s.arrived_s for s in sessions}
    start = min(s.arrived_s for s in sessions)
    return ReplayResult(policy.name, seed, sct, session_tool_s(calls, gap_factor), records, now - start, list(insts))
