"""Local replay: a trace through the scheduler over real instances (``talaria_jax.instance``) in one
process, next to the simulator's prediction of the same scenario.

Models: the embedded SmolLM2-135M-Instruct and the tiny test configs (configs/models/), random
weights for those, so switching is necessary and the shapes differ. A trace's model names map to
them by `model_map` (`LOCAL_TRACE`'s names are the local ones already). Token ids are real: each
call's prompt is its session's history plus deterministic tokens (`SessionTokens`), and the outputs
are the model's greedy tokens. Instance chunks report their measured seconds, so tool gaps cost no
wall time and two instances stepped one after the other replay as if side by side.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from talaria_jax.instance import Instance
from talaria_jax.scheduler.policies import PolicyConfig
from talaria_jax.scheduler.session import Call, SessionTable
from talaria_jax.sim.cluster import ReplayResult, run, tool_gap_factors
from talaria_jax.sim.traces import TraceSpec, generate

LOCAL_MODELS = ("smollm2-135m-instruct", "tiny-dense", "tiny-moe")

# 12 sessions of 4 calls over the three local models (Zipf popularity, as the default trace): prompts
# of a few hundred tokens so a CPU replays them in minutes; tool gaps keep docs/references.md's TraceLab
# distribution unscaled (median 0.3 s, p90 13.6 s), which is the order of a call's time here.
LOCAL_TRACE = TraceSpec(sessions=12, turns=4, models=LOCAL_MODELS, arrival_rate_per_s=0.5, system_tokens=(96, 320),
                        obs_median_tokens=48.0, obs_max_tokens=256, output_mean_tokens=24.0, output_range=(8, 64),
                        max_context_tokens=1024)
# The local replay's traces (talaria-replay --backend=local --local_trace=): LOCAL_TRACE, every session
# 3 calls (the demo's sessions), mixed lengths (most 1-5 calls, a quarter around 10), and LOCAL_TRACE's
# sessions on two models (a call after the first on another local model with probability 0.4)
LOCAL_TRACES = {"12x4": LOCAL_TRACE, "12x3": dataclasses.replace(LOCAL_TRACE, turns=3),
                "mixed": dataclasses.replace(LOCAL_TRACE, turns=2, turns_sigma=0.5, long_turns=10, long_share=0.25),
                "multi": dataclasses.replace(LOCAL_TRACE, second_model_share=0.4)}


def local_trace(spec: TraceSpec = LOCAL_TRACE) -> list[Call]:
    return generate(spec)


def map_models(calls: Sequence[Call], model_map: Mapping[str, str]) -> list[Call]:
    """Renames each call's model by `model_map`; a name the map lacks is an error naming it."""
    missing = sorted({c.model for c in calls} - set(model_map))
    if missing:
        raise ValueError(f"trace models {missing} have no local model (model_map has {sorted(model_map)})")
    return [dataclasses.replace(c, model=model_map[c.model]) for c in calls]


def replay_local(calls: Sequence[Call], policy: PolicyConfig, instances: Sequence[Instance], *, seed: int = 0,
                 gap_jitter_sigma: float = 0.0) -> ReplayResult:
    """Replays `calls` under `policy` on `instances` (reset first, so one set serves every policy)."""
    if any(inst.tokens is not instances[0].tokens for inst in instances):
        raise ValueError("the instances of a replay must share one SessionTokens (sessions move between them)")
    for inst in instances:
        inst.reset(host_kv=policy.host_kv, staging=policy.staging, drop_kv_on_switch=policy.drop_kv_on_switch)
    instances[0].tokens.clear()
    return run(calls, policy, instances, SessionTable(list(calls)), seed, tool_gap_factors(calls, seed, gap_jitter_sigma))
