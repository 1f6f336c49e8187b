"""talaria-replay: replay an agent-session trace through scheduling policies on a simulated cluster,
or (--backend=local) on real instances in this process, next to the simulator's prediction.

    python -m talaria_jax.launch.replay --trace=configs/traces/swebench-30x32.jsonl \
        --hardware=h200x8 --policies=talaria,round --seeds=0,1,2,3,4 --json_out=out/replay.json
    python -m talaria_jax.launch.replay --backend=local --policies=talaria,round,composite

The local backend (``talaria_jax.local``) replays a 12-session trace over SmolLM2-135M-Instruct and
two tiny models on two one-device instances by default (`--trace` and `--model_map` replay another
trace's calls on those models), and prints measured SCT per policy with the simulator's prediction
for the same calls, models and `--hardware` profile, and the relative error.

Prints one row per policy (seed-averaged): p50 / p95 / mean session completion time, calls/s,
model switches, KV tokens restored from host vs recomputed; then talaria's ratio to each policy.
A last row gives the per-session floor no policy can beat (``talaria_jax.sim.bounds``: tool time
plus each call alone on an idle instance, at nominal kernel cost, so the replay's kernel jitter may
dip a nearly idle session a few percent of its GPU time below it), and the last column each
policy's SCT over that floor: the largest speed-up over that policy any scheduler could show.

A trace model is a variant of the models table (--models_table) or, without a row there, a config
name under configs/models/ served in bf16. Before replaying, every call is checked to name such a
model and to fit the hardware (its context's KV plus its model's weights within the usable HBM); a
bad trace or config ends with one line, `talaria-replay: error: <file>:<line>: ...`, and exit 2.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Sequence

import numpy as np
from absl import app, flags

from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.scheduler.policies import DEFAULT_POLICIES, get_policy
from talaria_jax.sim.cluster import replay
from talaria_jax.sim.hardware import GIB, load_hardware
from talaria_jax.sim.compare import run_replay, trace_shapes
from talaria_jax.sim.instance import CapacityError
from talaria_jax.sim.traces import HINT_MODES, read_jsonl, with_hints

FLAGS = flags.FLAGS
flags.DEFINE_string("trace", str(CONFIG_DIR / "traces" / "swebench-30x32.jsonl"), "JSONL trace (docs/traces.md).")
flags.DEFINE_string("hardware", "h200x8", "Hardware config: a name under configs/hardware/ or a YAML path.")
flags.DEFINE_string("models_table", str(CONFIG_DIR / "hardware" / "models.yaml"), "Served model variants (a configs/models config + a precision) for the cost model.")
flags.DEFINE_list("policies", list(DEFAULT_POLICIES), "Policies to replay (talaria, round, load, sticky, composite, talaria-no-*, talaria-popular-first, "
                  "talaria-smith, talaria-round-robin, talaria-chain; a numeric field changed: 'talaria[patience=0.5]').")
flags.DEFINE_list("seeds", ["0", "1", "2", "3", "4"], "Seeds (run-to-run kernel and tool-time jitter).")
flags.DEFINE_float("tool_gap_scale", 1.0, "Multiply every tool gap of the trace by this (>= 0): how the ratios depend on tool time.")
flags.DEFINE_enum("hints", "trace", list(HINT_MODES), "The agent hints the calls carry (docs/serving.md \"Agent hints\"): "
                  "trace: as the trace has them; none; ends: only each session's last call says it ends it; true: "
                  "each call's real calls left and tool time; wrong: calls counted from the wrong end and another "
                  "call's tool time.")
flags.DEFINE_integer("servers", 1, "Servers, one TP instance each; every server can host every model.")
flags.DEFINE_string("json_out", "", "Write the results as JSON here.")
flags.DEFINE_string("plot", "", "Write an SCT CDF per policy (PNG) here (with --sweep: a heatmap of talaria's ratio "
                    "over each rival per cell); needs matplotlib.")
flags.DEFINE_bool("sweep", False, "Replay --policies in every cell of the regime matrix (talaria_jax/launch/sweep.py: "
                  "tool-gap scales x hardware x traces, plus an open-arrival load sweep) and mark the cells where "
                  "talaria is not best.")
flags.DEFINE_list("sweep_traces", [], "--sweep: only these traces (default, gen1, gen2, gen3, short, long, bimodal, "
                  "sparse, multi, open0.02, open0.03, open0.05).")
flags.DEFINE_list("noise_seeds", [], "--sweep: also replay talaria over these other seeds in every cell and print its "
                  "SCT there over its SCT on --seeds (how far the same policy moves between seed sets, next to the 2% tie).")
flags.DEFINE_string("timeline", "", "Write each policy's model slots per instance and calls per session over time "
                    "(PNG, first seed) here; needs matplotlib.")
flags.DEFINE_enum("backend", "sim", ["sim", "local"], "sim: simulated instances; local: real JAX instances here.")
flags.DEFINE_list("local_models", ["smollm2-135m-instruct", "tiny-dense", "tiny-moe"],
                  "--backend=local: the models each instance hosts (named models or configs/models/ names).")
flags.DEFINE_string("local_weight_budget", "largest", "--backend=local: device bytes each instance's models' "
                    "weights may take: 'largest' (the largest model's; the models take turns and a switch to an "
                    "evicted one copies it from host memory), a number of bytes, 'all' (every model stays), or "
                    "'slot' (one weight slot the models share, carved inside every step).")
flags.register_validator("local_weight_budget",
                         lambda v: v in ("all", "largest", "slot") or (v.isdigit() and int(v) > 0),
                         "must be 'largest', 'all', 'slot' or a number of bytes")
flags.DEFINE_enum("local_trace", "12x4", ["12x4", "12x3", "mixed", "multi"], "--backend=local without --trace: the "
                  "local trace (talaria_jax.local.LOCAL_TRACES): 12 sessions of 4 calls, of 3, of mixed lengths, or "
                  "of 4 calls whose later calls may run on a second model.")
flags.DEFINE_list("model_map", [], "--backend=local: trace model -> local model pairs (name=local); default: the "
                  "local 12-session trace, whose names are the local models'.")
flags.DEFINE_integer("devices_per_instance", 1, "--backend=local: devices (TP) of each instance (default "
                     "--servers there: 2; default --hardware: cpu, the profile talaria-calibrate wrote).")

def _parse_seeds(raw: Sequence[str], flag: str = "--seeds") -> list[int]:
    out = []
    for s in raw:
        try:
            out.append(int(s))
        except ValueError:
            raise app.UsageError(f"{flag}: {s!r} is not an integer") from None
    if not out:
        raise app.UsageError(f"{flag}: give at least one seed")
    return out


def format_table(res: dict) -> str:
    """A markdown table, one row per policy, plus talaria's speed-up over each."""
    scale = res.get("tool_gap_scale", 1.0)
    lines = [f"trace `{pathlib.Path(res['trace']).name}`, hardware `{res['hardware']}`, servers {res['servers']}, "
             f"seeds {','.join(map(str, res['seeds']))}" + (f", tool gaps x{scale:g}" if scale != 1.0 else "")
             + (f", hints {res['hints']}" if res.get("hints", "trace") != "trace" else "")
             + " (figures are means over seeds)", "",
             "| policy | SCT p50 (s) | SCT p95 (s) | SCT mean (s) | calls/s | switches | pauses | KV restored from host (Mtok) "
             "| prefix recomputed (Mtok) | talaria speed-up p50 / p95 | speed-up ceiling p50 / p95 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    sp, ceil = res.get("talaria_speedup", {}), res.get("speedup_ceiling", {})
    pair = lambda d, n: f"{d[n]['p50']:.2f}x / {d[n]['p95']:.2f}x" if n in d else "-"
    for name, v in res["policies"].items():
        lines.append(f"| {name} | {v['sct_p50_s']:.0f} | {v['sct_p95_s']:.0f} | {v['sct_mean_s']:.0f} | "
                     f"{v['calls_per_s']:.2f} | {v['model_switches']:.0f} | {v.get('pauses', 0):.0f} | {v['kv_restored_tokens'] / 1e6:.1f} | "
                     f"{v['kv_recomputed_tokens'] / 1e6:.1f} | {pair(sp, name)} | {pair(ceil, name)} |")
    if "floor" in res:
        f = res["floor"]
        lines.append(f"| floor (any policy) | {f['sct_p50_s']:.0f} | {f['sct_p95_s']:.0f} | {f['sct_mean_s']:.0f} "
                     f"| | | | | | | |")
    return "\n".join(lines)


def plot_cdf(res: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise app.UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, v in res["policies"].items():
        x = np.sort(np.concatenate([np.asarray(s) for s in v["sct_s"]]))
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=name)
    ax.set_xlabel("session completion time (s)")
    ax.set_ylabel("CDF over sessions and seeds")
    ax.set_xscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_local(trace: str | None, hardware: str, policies: Sequence[str], servers: int, local_models: Sequence[str],
              model_map: dict[str, str], devices_per_instance: int, tool_gap_scale: float = 1.0,
              seeds: Sequence[int] = (0,), hints: str = "trace", local_trace: str = "12x4",
              weight_budget: str = "largest") -> dict:
    """Replays every policy on real instances (after every step shape of every model has compiled; any
    compiling a measured replay still meets is left out of its chunks' seconds), the policies
    interleaved seed by seed, then the simulator on the same calls, models, hardware and tool-time
    jitter (seeded per call as in the simulator; kernel time is the real engine's own). `trace` None:
    `local.LOCAL_TRACES[local_trace]`. `weight_budget`: the models keep arrays of their own and take
    turns on each instance's devices under it (``instance.resolve_weight_budget``; "all": every model
    stays; "slot": one weight slot they share); the simulator's instances get the same device memory
    (weights plus the KV arena). The results carry the load average before the first replay."""
    load_average = os.getloadavg()[0]
    from talaria_jax.engine.engine import EngineConfig
    from talaria_jax import local
    from talaria_jax.instance import SessionTokens, build_instances

    calls = local.local_trace(local.LOCAL_TRACES[local_trace]) if trace is None else local.map_models(read_jsonl(trace), model_map)
    calls = [dataclasses.replace(c, tool_gap_s=c.tool_gap_s * tool_gap_scale) for c in calls]
    calls = with_hints(calls, hints)
    hw = dataclasses.replace(load_hardware(hardware), num_gpus=devices_per_instance)
    longest = max(c.context_after for c in calls)
    ec = EngineConfig(max_seqs=8, max_tokens_per_step=256, max_model_len=longest + 16, warmup=False)
    insts = build_instances(local_models, hw, instances=servers, devices_per_instance=devices_per_instance,
                            engine_config=ec, tokens=SessionTokens(), exclude_compiles=True,
                            weight_budget=weight_budget)
    shapes = insts[0].shapes()
    # the simulator's device memory is the real instance's: the weights it may hold and its KV arena
    hw = dataclasses.replace(hw, hbm_gib_per_gpu=insts[0].capacity / devices_per_instance / GIB, memory_utilization=1.0)
    # Every step shape and host copy of every model compiles first (`Instance.warmup`; with layer programs
    # about 2 min an instance on 2 cores, 4.5 GB peak RSS for two), so no measured replay meets a compile:
    # batches move with the seeds' tool times, so a warm-up replay per policy would leave shapes that a
    # measured one compiles. The instances still leave any compiling out of the chunks' seconds
    # (`exclude_compiles`).
    for inst in insts:
        t = time.perf_counter()
        inst.warmup()
        print(f"{inst.name}: every step shape compiled in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    out: dict = {"backend": "local", "trace": trace or f"local-{local_trace}", "hardware": hw.name, "servers": servers,
                 "weight_budget": weight_budget,
                 "models": list(local_models), "devices_per_instance": devices_per_instance, "seeds": list(seeds),
                 "hints": hints, "load_average": load_average, "policies": {}}
    keys = ("sct_p50_s", "sct_p95_s")
    per_policy: dict[str, list] = {name: [] for name in policies}
    for seed in seeds:  # the policies interleaved, seed by seed, so a drift of the machine reaches them alike
        for name in policies:
            pol = get_policy(name)
            t = time.perf_counter()
            real = local.replay_local(calls, pol, insts, seed=seed, gap_jitter_sigma=_GAP_SIGMA)
            print(f"{name}, seed {seed}: replayed in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            sim = replay(calls, pol, hw, shapes, servers=servers, seed=seed, jitter_sigma=0.0,
                         gap_jitter_sigma=_GAP_SIGMA, page_bytes=insts[0].page_bytes)
            per_policy[name].append({"measured": {**real.summary(), "sct_s": real.sct_s},
                                     "simulated": {**sim.summary(), "sct_s": sim.sct_s}})
    for name, runs in per_policy.items():
        mean = lambda side: {k: float(np.mean([r[side][k] for r in runs])) for k in runs[0][side] if k != "sct_s"}
        m, sim = mean("measured"), mean("simulated")
        m["sct_p90_s"] = float(np.mean([np.quantile(list(r["measured"]["sct_s"].values()), 0.9) for r in runs]))
        out["policies"][name] = {"measured": m, "simulated": sim, "per_seed": runs,
                                 "relative_error": {k: sim[k] / m[k] - 1.0 for k in keys}}
    if "round" in out["policies"]:  # each session's measured SCT over its SCT under round, same seed
        base = out["policies"]["round"]["per_seed"]
        for v in out["policies"].values():
            v["worst_over_round"] = worst_session_ratio([r["measured"]["sct_s"] for r in v["per_seed"]],
                                                        [b["measured"]["sct_s"] for b in base])
    order = lambda side, k: sorted(out["policies"], key=lambda n: out["policies"][n][side][k])
    out["same_order"] = {k: order("measured", k) == order("simulated", k) for k in keys}
    return out


def worst_session_ratio(runs: Sequence[dict[str, float]], base: Sequence[dict[str, float]]) -> float:
    """The largest SCT of a session in `runs` (one session -> SCT dict per seed) over its SCT in
    `base` with the same seed."""
    return max(r[s] / b[s] for r, b in zip(runs, base, strict=True) for s in b)


_GAP_SIGMA = 0.1  # tool-time jitter per call (the simulator's default), the same draws on both sides


def format_local_table(res: dict) -> str:
    load = f"; load average {res['load_average']:.2f} at the start" if "load_average" in res else ""
    lines = [f"local replay of `{res['trace']}` on {res['servers']} instances x {res['devices_per_instance']} device(s), "
             f"models {', '.join(res['models'])}, weight budget {res.get('weight_budget', 'largest')}; simulator "
             f"with hardware `{res['hardware']}`{load}", "",
             "| policy | measured SCT p50 (s) | p90 (s) | p95 (s) | simulated p50 (s) | p95 (s) | error p50 | error p95 "
             "| switches | pauses | s per switch | KV restored (tok) | prefix recomputed (tok) | worst session / round |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, v in res["policies"].items():
        m, s, e = v["measured"], v["simulated"], v["relative_error"]
        worst = f"{v['worst_over_round']:.2f}x" if "worst_over_round" in v else "-"
        lines.append(f"| {name} | {m['sct_p50_s']:.1f} | {m['sct_p90_s']:.1f} | {m['sct_p95_s']:.1f} | {s['sct_p50_s']:.1f} "
                     f"| {s['sct_p95_s']:.1f} | {e['sct_p50_s']:+.0%} | {e['sct_p95_s']:+.0%} | {m['model_switches']:.0f} "
                     f"| {m.get('pauses', 0):.0f} | {m['switch_time_s'] / max(m['model_switches'], 1):.2f} | {m['kv_restored_tokens']:.0f} | {m['kv_recomputed_tokens']:.0f} | {worst} |")
    same = res["same_order"]
    lines += ["", "tracing and compiling left out of the measured chunks (s per replay, means): "
              + ", ".join(f"{name} {v['measured'].get('compile_s', 0.0):.1f}" for name, v in res["policies"].items())]
    lines += ["", f"seeds {','.join(map(str, res['seeds']))} (means); the simulator ranks the policies in the measured "
              f"order at p50: {'yes' if same['sct_p50_s'] else 'no'}, at p95: {'yes' if same['sct_p95_s'] else 'no'}"]
    return "\n".join(lines)


def _parse_map(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        name, sep, local_name = p.partition("=")
        if not sep or not name or not local_name:
            raise app.UsageError(f"--model_map: {p!r} is not name=local_model")
        out[name] = local_name
    return out


def main(argv: Sequence[str]) -> None:
    try:
        _main(argv)
    except (ValueError, CapacityError) as e:  # TraceError and ConfigError are ValueErrors
        print(f"talaria-replay: error: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
        sys.exit(2)


def _main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.backend == "local":
        _main_local()
        return
    if FLAGS.servers < 1:
        raise app.UsageError(f"--servers={FLAGS.servers} must be >= 1")
    if not FLAGS.tool_gap_scale >= 0:
        raise app.UsageError(f"--tool_gap_scale={FLAGS.tool_gap_scale} must be >= 0")
    for p in FLAGS.policies:
        try:
            get_policy(p)
        except ValueError as e:
            raise app.UsageError(f"--policies: {e}") from None
    seeds = _parse_seeds(FLAGS.seeds)
    if FLAGS.noise_seeds and not FLAGS.sweep:
        raise app.UsageError("--noise_seeds needs --sweep")
    if FLAGS.sweep:
        from talaria_jax.launch import sweep

        ignored = [f"--{n}" for n in ("hardware", "servers", "tool_gap_scale", "timeline") if FLAGS[n].present]
        if ignored:
            raise app.UsageError(f"--sweep sets the hardware, servers and tool gaps of each cell itself: drop {', '.join(ignored)}")
        if FLAGS.plot:
            sweep.pyplot()  # fail before the sweep, not after it
        noise = _parse_seeds(FLAGS.noise_seeds, "--noise_seeds") if FLAGS.noise_seeds else []
        res = sweep.run_sweep(FLAGS.policies, seeds, FLAGS.trace, FLAGS.sweep_traces or None,
                              progress=lambda m: print(m, file=sys.stderr), noise_seeds=noise, hints=FLAGS.hints)
        print(sweep.format_sweep(res))
        _write_json(res)
        if FLAGS.plot:
            sweep.plot_heatmap(res, FLAGS.plot)
            print(f"wrote {FLAGS.plot}", file=sys.stderr)
        return
    res = run_replay(FLAGS.trace, FLAGS.hardware, FLAGS.policies, seeds, FLAGS.servers,
                     FLAGS.models_table, FLAGS.tool_gap_scale, FLAGS.hints)
    print(format_table(res))
    _write_json(res)
    if FLAGS.plot:
        plot_cdf(res, FLAGS.plot)
        print(f"wrote {FLAGS.plot}", file=sys.stderr)
    if FLAGS.timeline:
        from talaria_jax.launch import sweep

        trace, hw = read_jsonl(FLAGS.trace), load_hardware(FLAGS.hardware)
        shapes = trace_shapes(trace, hw, FLAGS.models_table)
        calls = [dataclasses.replace(c, tool_gap_s=c.tool_gap_s * FLAGS.tool_gap_scale) for c in trace]
        calls = with_hints(calls, FLAGS.hints, seeds[0])
        runs = {n: replay(calls, get_policy(n), hw, shapes, servers=FLAGS.servers, seed=seeds[0]) for n in FLAGS.policies}
        sweep.plot_timeline(runs, FLAGS.timeline)
        print(f"wrote {FLAGS.timeline}", file=sys.stderr)


def _write_json(res: dict) -> None:
    if FLAGS.json_out:
        pathlib.Path(FLAGS.json_out).parent.mkdir(parents=True, exist_ok=True)
        with open(FLAGS.json_out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {FLAGS.json_out}", file=sys.stderr)


def _main_local() -> None:
    servers = FLAGS.servers if FLAGS["servers"].present else 2  # two instances, so placement matters
    if FLAGS.devices_per_instance < 1:
        raise app.UsageError(f"--devices_per_instance={FLAGS.devices_per_instance} must be >= 1")
    from talaria_jax.sharding import simulate_cpu_devices

    simulate_cpu_devices(servers * FLAGS.devices_per_instance)
    trace_given = FLAGS["trace"].present
    hardware = FLAGS.hardware if FLAGS["hardware"].present else "cpu"  # talaria-calibrate's profile
    seeds = _parse_seeds(FLAGS.seeds) if FLAGS["seeds"].present else [0]  # a local replay takes minutes
    res = run_local(FLAGS.trace if trace_given else None, hardware, FLAGS.policies, servers, FLAGS.local_models,
                    _parse_map(FLAGS.model_map), FLAGS.devices_per_instance, FLAGS.tool_gap_scale, seeds,
                    FLAGS.hints, FLAGS.local_trace, FLAGS.local_weight_budget)
    print(format_local_table(res))
    _write_json(res)


def run() -> None:
    """Console-script entry point (talaria-replay)."""
    app.run(main)


if __name__ == "__main__":
    run()
