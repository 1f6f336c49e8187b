"""How the simulator's replay scales with the cluster: wall time of one policy's replay of a generated
trace on `--servers` simulated H200 TP=8 instances.

The trace is `configs/traces/cluster-120x32.jsonl`'s recipe scaled with the cluster: the six cluster
models (Zipf popularity), `--sessions` sessions (default 30 per server) of `--turns` calls, arriving
at 0.5 sessions/s per server (the 120x32 trace loads its 4 servers at 2/s), so every server sees the
load one server of the cluster scenario sees. Prints the calls, the replay's wall time, calls
simulated per wall second, chunks per call, and SCT p50/p95.

  .venv/bin/python -m benchmarks.sim_scale --servers=64
  .venv/bin/python -m benchmarks.sim_scale --servers=16 --profile=30  # and the top 30 of cProfile
"""
from __future__ import annotations

import cProfile
import pstats
import time

from absl import app, flags

from benchmarks import common
from talaria_jax.scheduler import get_policy
from talaria_jax.sim.cluster import replay
from talaria_jax.sim.hardware import load_hardware, load_models
from talaria_jax.sim.traces import TraceSpec, generate

CLUSTER_MODELS = ("qwen3-235b-a22b", "glm-4.5-fp8", "llama-3.1-405b-fp8", "qwen3-235b-a22b-fp8", "glm-4.5-air-fp8",
                  "gpt-oss-120b")  # cluster-120x32's models, in rank order (docs/traces.md)
RATE_PER_SERVER = 0.5  # sessions/s: cluster-120x32 arrives at 2/s on 4 servers

_SERVERS = flags.DEFINE_integer("servers", 64, "Simulated instances (each an H200 TP=8 hosting every model).")
_SESSIONS = flags.DEFINE_integer("sessions", None, "Sessions in the trace (default 30 per server).")
_TURNS = flags.DEFINE_integer("turns", 32, "Calls per session.")
_RATE = flags.DEFINE_float("arrival_rate_per_s", None, f"Session arrivals per second (default {RATE_PER_SERVER} per server).")
_POLICY = flags.DEFINE_string("policy", "talaria", "Scheduling policy (talaria_jax.scheduler.POLICIES).")
_SEED = flags.DEFINE_integer("seed", 0, "Replay seed (kernel and tool-time jitter).")
_HARDWARE = flags.DEFINE_string("hardware", "h200x8", "Hardware config (configs/hardware/).")
_PROFILE = flags.DEFINE_integer("profile", 0, "If > 0, replay under cProfile and print this many top functions.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def bench(servers: int, sessions: int | None = None, turns: int = 32, policy: str = "talaria", seed: int = 0,
          rate: float | None = None, hardware: str = "h200x8", profile: int = 0) -> dict:
    sessions = sessions or 30 * servers
    rate = rate or RATE_PER_SERVER * servers
    t0 = time.perf_counter()
    calls = generate(TraceSpec(sessions=sessions, turns=turns, arrival_rate_per_s=rate, models=CLUSTER_MODELS))
    gen_s = time.perf_counter() - t0
    hw, shapes = load_hardware(hardware), load_models()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    res = replay(calls, get_policy(policy), hw, shapes, servers=servers, seed=seed)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    s = res.summary()
    out = {"servers": servers, "sessions": sessions, "turns": turns, "arrival_rate_per_s": rate, "policy": policy,
           "seed": seed, "calls": s["calls"], "generate_s": gen_s, "replay_wall_s": wall,
           "sim_calls_per_wall_s": s["calls"] / wall, "chunks_per_call": s["chunks_per_call"],
           "sct_p50_s": s["sct_p50_s"], "sct_p95_s": s["sct_p95_s"], "makespan_s": s["makespan_s"],
           "model_switches": s["model_switches"], "profiled": bool(profile)}
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(profile)
    return out


def main(argv):
    del argv
    r = bench(_SERVERS.value, _SESSIONS.value, _TURNS.value, _POLICY.value, _SEED.value, _RATE.value,
              _HARDWARE.value, _PROFILE.value)
    print(f"servers {r['servers']}, sessions {r['sessions']} x {r['turns']} turns at {r['arrival_rate_per_s']:g}/s, "
          f"policy {r['policy']}, seed {r['seed']}" + (" (under cProfile)" if r["profiled"] else ""))
    print(f"calls {r['calls']}  replay wall {r['replay_wall_s']:.1f} s  ({r['sim_calls_per_wall_s']:.0f} calls/s simulated; "
          f"trace generated in {r['generate_s']:.1f} s)")
    print(f"chunks/call {r['chunks_per_call']:.2f}  SCT p50 {r['sct_p50_s']:.1f} s  p95 {r['sct_p95_s']:.1f} s  "
          f"makespan {r['makespan_s']:.0f} s  switches {r['model_switches']}")
    common.write_json(_OUT.value, r)


if __name__ == "__main__":
    app.run(main)
