"""Replaying policies over seeds on the simulator and aggregating what they give (talaria-replay and
its --sweep share it): seed-averaged SCT quantiles per policy, the floor, talaria's speed-ups."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from talaria_jax.models.config import available_models
from talaria_jax.scheduler.policies import get_policy
from talaria_jax.scheduler.session import Call
from talaria_jax.sim.bounds import sct_floor_s
from talaria_jax.sim.cluster import replay
from talaria_jax.sim.cost import CostModel
from talaria_jax.sim.hardware import HardwareConfig, ModelShape, load_hardware, load_models
from talaria_jax.sim.traces import Trace, TraceError, read_jsonl, with_hints

_AGG_KEYS = ("sct_p50_s", "sct_p95_s", "sct_mean_s", "calls_per_s", "makespan_s", "model_switches", "switch_time_s",
             "pauses", "kv_restored_tokens", "kv_recomputed_tokens", "kv_device_hit_tokens", "prefill_tokens", "peak_hbm_fraction")


def check_trace(calls: Trace, hw: HardwareConfig, shapes: dict[str, ModelShape], page_bytes: int = 4 * 2**20) -> None:
    """Raises ``TraceError`` naming the file and line of the first call whose model has no shape, or
    whose context (prompt + output) needs more KV pages than the usable HBM leaves beside its model's
    weights (the replay would otherwise stop at that call with a ``CapacityError``)."""
    seen = set()
    for c in calls:
        if c.model not in seen:
            seen.add(c.model)
            if c.model not in shapes:
                known = ", ".join(sorted(set(shapes) | set(available_models())))
                raise TraceError(f"{calls.where(c.key)}: model {c.model!r} has no shape in the models table "
                                 f"(known: {known})")
        m = shapes[c.model]
        kv = math.ceil(c.context_after * m.kv_bytes_per_token / page_bytes) * page_bytes
        if kv > (hw.usable_hbm_bytes - m.weight_bytes) // page_bytes * page_bytes:
            raise TraceError(f"{calls.where(c.key)}: call {c.key} needs {kv / 1e9:.1f} GB of KV + "
                             f"{m.weight_bytes / 1e9:.1f} GB of weights, more than the usable HBM "
                             f"{hw.usable_hbm_bytes / 1e9:.1f} GB of {hw.name}")


def run_replay(trace: str, hardware: str, policies: Sequence[str], seeds: Sequence[int], servers: int = 1,
               models_table: str | None = None, tool_gap_scale: float = 1.0, hints: str = "trace") -> dict:
    """Replays every policy for every seed; returns the JSON-ready results (seed-averaged figures
    per policy, per-seed figures and every session's SCT). `tool_gap_scale` multiplies every tool gap;
    `hints` is a `traces.with_hints` mode (the agent hints the calls carry)."""
    calls = read_jsonl(trace)
    hw = load_hardware(hardware)
    return replay_calls(calls, str(trace), hw, trace_shapes(calls, hw, models_table), policies, seeds, servers,
                        tool_gap_scale, hints)


def trace_shapes(calls: Trace, hw: HardwareConfig, models_table: str | None = None) -> dict[str, ModelShape]:
    """The cost-model shapes of the trace's models, after checking that every call fits (`check_trace`)."""
    models = dict.fromkeys(c.model for c in calls)
    shapes = load_models(models_table, extra=models) if models_table else load_models(extra=models)
    check_trace(calls, hw, shapes)
    return shapes


def replay_calls(calls: Sequence[Call], label: str, hw: HardwareConfig, shapes: dict[str, ModelShape],
                 policies: Sequence[str], seeds: Sequence[int], servers: int = 1, tool_gap_scale: float = 1.0,
                 hints: str = "trace") -> dict:
    """`run_replay` over calls already loaded and checked (`label` names them in the results)."""
    if not tool_gap_scale >= 0:
        raise ValueError(f"tool_gap_scale={tool_gap_scale} must be >= 0")
    if tool_gap_scale != 1.0:
        calls = [dataclasses.replace(c, tool_gap_s=c.tool_gap_s * tool_gap_scale) for c in calls]
    hinted = {seed: with_hints(calls, hints, seed) for seed in seeds}  # (wrong hints: drawn per seed)
    out: dict = {"trace": label, "hardware": hw.name, "servers": servers, "seeds": list(seeds),
                 "tool_gap_scale": tool_gap_scale, "hints": hints, "policies": {}}
    floors: dict[int, np.ndarray] = {}  # seed -> per-session floors (tool time is common to all policies)
    for name in policies:
        pol = get_policy(name)
        per_seed, scts = [], []
        for seed in seeds:
            r = replay(hinted[seed], pol, hw, shapes, servers=servers, seed=seed)
            per_seed.append(r.summary())
            scts.append(sorted(r.sct_s.values()))
            if seed not in floors:
                floors[seed] = np.array(sorted(sct_floor_s(calls, CostModel(hw), shapes, r.tool_s).values()))
        agg = {k: float(np.mean([s[k] for s in per_seed])) for k in _AGG_KEYS}
        agg["sct_p50_s_range"] = [min(s["sct_p50_s"] for s in per_seed), max(s["sct_p50_s"] for s in per_seed)]
        agg["sct_p95_s_range"] = [min(s["sct_p95_s"] for s in per_seed), max(s["sct_p95_s"] for s in per_seed)]
        agg["per_seed"] = per_seed
        agg["sct_s"] = scts
        out["policies"][name] = agg
    if floors:
        out["floor"] = {k: float(np.mean([np.quantile(f, q) for f in floors.values()]))
                        for k, q in (("sct_p50_s", 0.5), ("sct_p95_s", 0.95))}
        out["floor"]["sct_mean_s"] = float(np.mean([f.mean() for f in floors.values()]))
        out["speedup_ceiling"] = {n: {"p50": v["sct_p50_s"] / out["floor"]["sct_p50_s"],
                                      "p95": v["sct_p95_s"] / out["floor"]["sct_p95_s"]}
                                  for n, v in out["policies"].items()}
    if "talaria" in out["policies"]:
        t = out["policies"]["talaria"]
        out["talaria_speedup"] = {n: {"p50": v["sct_p50_s"] / t["sct_p50_s"], "p95": v["sct_p95_s"] / t["sct_p95_s"]}
                                  for n, v in out["policies"].items() if n != "talaria"}
    return out


