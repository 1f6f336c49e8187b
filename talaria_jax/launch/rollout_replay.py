"""talaria-rollout-replay: one synchronous RL rollout step replayed on simulated replicas, WAR against
its baselines (rollout/replay.py: the real placement, suffix drafter and speculation policy over a
hardware profile's cost model).

    talaria-rollout-replay --hardware=h200x8 --model=qwen3-235b-a22b-fp8 --replicas=8 --prompts=8 --samples=8

The step is generated (`--prompts` x `--samples` trajectories of `--turns` model turns, lengths and
repetition as the flags say; `--workload=agentic`: SWE-style trajectories of 10-50 turns whose context
grows to 40K tokens, `rollout.replay.AgenticShape`) or read from `--trajectories` (JSONL,
`rollout.replay.write_jsonl`'s format). Every configuration replays the same tokens; only the time
differs. Each replica holds `--kv_tokens` of KV (the profile's by default) and `--host_kv_tokens` in
its host tier (none by default); the tables count the context tokens found in KV, those computed again, and preemptions.

`--sweep` replays a generated step at each load it lists (trajectories per replica: `--prompts` is
that x `--replicas` / `--samples`) and prints each configuration's tokens/s and WAR's ratios:

    talaria-rollout-replay --replicas=8 --sweep=1,4,16,64 --sweep_plot=sweep.png
"""
from __future__ import annotations

import time
from typing import Sequence

from absl import app, flags

CONFIGS = {  # name: (placement, speculation)
    "baseline": ("round_robin", False),  # data-parallel rollouts: round-robin, no speculation
    "sticky_least_loaded": ("sticky_least_loaded", False),  # RL frameworks' default router today
    "placement_only": ("cache_aware", False),
    "spec_only": ("round_robin", True),
    "war": ("cache_aware", True),  # cache-aware placement, suffix drafts where the policy finds they pay
}

_HARDWARE = flags.DEFINE_string("hardware", "h200x8", "Hardware profile of one replica (configs/hardware).")
_MODEL = flags.DEFINE_string("model", "qwen3-235b-a22b-fp8", "Model variant (configs/hardware/models.yaml).")
_REPLICAS = flags.DEFINE_integer("replicas", 8, "Rollout replicas.", lower_bound=1)
_PER_HOST = flags.DEFINE_integer("replicas_per_host", 1, "Replicas sharing one host's compute (a CPU's cores; the "
                                 "profile's colocated_step_slowdown prices it). GPU replicas own theirs: 1.",
                                 lower_bound=1)
_MAX_SEQS = flags.DEFINE_integer("max_seqs", 64, "Batch slots per replica.", lower_bound=1)
_STEP_TOKENS = flags.DEFINE_integer("max_tokens_per_step", 2048, "Token budget of an engine step.", lower_bound=1)
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Prompts of the step (GRPO groups).", lower_bound=1)
_SAMPLES = flags.DEFINE_integer("samples", 8, "Samples per prompt.", lower_bound=1)
_TURNS = flags.DEFINE_list("turns", ["1", "4"], "Model turns per trajectory: min,max (uniform).")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 2048, "Tokens of each prompt.", lower_bound=1)
_OUTPUT_TOKENS = flags.DEFINE_float("output_tokens", 512, "Median output tokens of a turn.", lower_bound=1)
_OUTPUT_SIGMA = flags.DEFINE_float("output_sigma", 0.8, "Lognormal sigma of output lengths.", lower_bound=0)
_MAX_OUTPUT = flags.DEFINE_integer("max_output", 8192, "Output tokens of a turn at most.", lower_bound=1)
_OBSERVATION = flags.DEFINE_integer("observation_tokens", 512, "Tool output tokens before each later turn.",
                                    lower_bound=1)
_TOOL_S = flags.DEFINE_float("tool_s", 2.0, "Tool seconds between turns.", lower_bound=0)
_REPETITION = flags.DEFINE_float("repetition", 0.5, "Share of output phrases drawn from the task's pool.",
                                 lower_bound=0, upper_bound=1)
_SPEC = flags.DEFINE_integer("max_spec_tokens", 8, "Draft tokens per sequence and step at most.", lower_bound=1)
_WORKLOAD = flags.DEFINE_enum("workload", "synthetic", ["synthetic", "agentic"], "The generated step: synthetic (the "
                              "--turns, --prompt_tokens, --output_tokens, --observation_tokens and --tool_s flags) "
                              "or agentic (SWE-style trajectories of 10-50 turns whose context grows to 40K tokens, "
                              "with cited tool times: rollout.replay.AgenticShape; --tool_scale).")
_TOOL_SCALE = flags.DEFINE_float("tool_scale", 1.0, "--workload=agentic: the cited tool seconds times this (0: turns "
                                 "back to back).", lower_bound=0)
_KV_TOKENS = flags.DEFINE_integer("kv_tokens", None, "KV tokens a replica holds (default: what the profile's HBM "
                                  "holds beside the weights).", lower_bound=1)
_HOST_KV = flags.DEFINE_integer("host_kv_tokens", 0, "KV tokens a replica's host tier holds: blocks evicted from "
                                "its HBM go there and are restored where that beats recomputing them (0: none; the "
                                "engine keeps no host copies of evicted prefix blocks).", lower_bound=0)
_TRAJECTORIES = flags.DEFINE_string("trajectories", None, "A JSONL file of trajectories to replay instead.")
_CONFIGS = flags.DEFINE_list("configs", list(CONFIGS), f"Configurations: {', '.join(CONFIGS)}.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated step.")
_DRAFTER = flags.DEFINE_enum("drafter", "auto", ["auto", "native", "python"], "The suffix drafter's backend: the "
                             "compiled one where built (auto), or the Python reference; the drafts are the same.")
_SWEEP = flags.DEFINE_list("sweep", None, "Trajectories per replica: replay a generated step at each load and print "
                           "every configuration's tokens/s and WAR's ratios (--prompts is ignored).")
_SWEEP_PLOT = flags.DEFINE_string("sweep_plot", None, "--sweep: plot each configuration's tokens/s over the "
                                  "baseline's against the load here (PNG).")
_PLOT = flags.DEFINE_string("plot", None, "Write a timeline of each configuration's step here (PNG): per replica, "
                            "its prefill, decode and verify steps, and the idle time until the last trajectory.")
COLORS = {"prefill": "tab:orange", "decode": "tab:blue", "verify": "tab:green"}


def plot_timelines(results: dict, path: str) -> None:
    """One panel per configuration: a lane per replica, its steps coloured by kind, the gaps idle,
    and the step's end (its last trajectory) as a line. Consecutive steps of one kind are merged."""
    from talaria_jax.launch.sweep import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.2 + 0.35 * len(next(iter(results.values())).timeline)
                                                       * len(results)), sharex=True, squeeze=False)
    for ax, (name, res) in zip(axes[:, 0], results.items()):
        for lane, spans in enumerate(res.timeline):
            merged: list[list] = []
            for start, end, kind in spans:
                if merged and merged[-1][2] == kind and start - merged[-1][1] < 1e-6:
                    merged[-1][1] = end
                else:
                    merged.append([start, end, kind])
            for kind, color in COLORS.items():
                bars = [(a, b - a) for a, b, k in merged if k == kind]
                ax.broken_barh(bars, (lane - 0.4, 0.8), color=color, label=kind if lane == 0 else None)
        ax.axvline(res.step_s, color="black", lw=1)
        ax.set_yticks(range(len(res.timeline)))
        ax.set_yticklabels([f"r{i}" for i in range(len(res.timeline))], fontsize=7)
        ax.set_title(f"{name}: step {res.step_s:.1f} s, {res.tokens_per_s:.0f} tok/s", fontsize=9, loc="left")
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("seconds (white: idle; the line: the last trajectory ends)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replay_configs(trajs, shape, replicas: int, configs: Sequence[str], max_spec_tokens: int,
                   replicas_per_host: int = 1, drafter: str = "auto"):
    """Each configuration's replay of the same step, as it ends: (name, ReplayedStep, seconds it took here);
    `drafter`: the suffix drafter's backend."""
    from talaria_jax.engine.spec import SpecConfig
    from talaria_jax.rollout.replay import replay_step

    for name in configs:
        placement, speculate = CONFIGS[name]
        t = time.perf_counter()
        try:
            res = replay_step(trajs, shape, replicas, placement,
                              SpecConfig(max_spec_tokens=max_spec_tokens) if speculate else None, replicas_per_host,
                              drafter)
        except ValueError as e:  # trajectories the replicas cannot hold, named
            raise app.UsageError(str(e)) from None
        yield name, res, time.perf_counter() - t


def print_step(results) -> dict:
    """Prints each configuration's row as its replay ends (the baseline's tok/s is the unit once it
    has run); returns name -> (ReplayedStep, seconds)."""
    print("| config | step s | tok/s | over baseline | prefill tokens | hit rate | recomputed | preempted | verify steps "
          "| accepted / drafted | replay s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    out, base = {}, None
    for name, res, wall in results:
        out[name] = res, wall
        base = base or (res.tokens_per_s if name == "baseline" else None)
        gain = f"{res.tokens_per_s / base:.2f}x" if base else "-"
        acc = f"{res.accepted} / {res.drafted}" if CONFIGS[name][1] else "-"
        print(f"| {name} | {res.step_s:.1f} | {res.tokens_per_s:.0f} | {gain} | {res.prefill_tokens} | "
              f"{res.hit_rate:.0%} | {res.recomputed_tokens} | {res.preemptions} | {res.verify_steps} of {res.steps} | "
              f"{acc} | {wall:.1f} |", flush=True)
    return out


def print_sweep(rows: list[dict], configs: Sequence[str]) -> None:
    """A row per load: the baseline's and WAR's tok/s, each configuration's over the baseline's, WAR's
    over sticky-least-loaded's, the share of WAR's steps that verified drafts, and for the baseline,
    sticky-least-loaded and WAR the share of context tokens found in KV (device or host), the tokens
    computed again and the preemptions."""
    ratios = [(c, "baseline") for c in configs if c != "baseline"]
    if "war" in configs and "sticky_least_loaded" in configs:
        ratios.append(("war", "sticky_least_loaded"))
    shown = [c for c in ("baseline", "war") if c in configs]
    kv = [c for c in ("baseline", "sticky_least_loaded", "war") if c in configs]
    names = " / ".join("sticky" if c == "sticky_least_loaded" else c for c in kv)
    print("| per replica | trajectories | output tokens | " + " | ".join(f"{c} tok/s" for c in shown) + " | "
          + " | ".join(f"{a} / {b}" for a, b in ratios) + f" | war steps verifying | hit rate ({names}) | "
          f"recomputed K tokens ({names}) | preempted ({names}) | replay s |")
    print("|" + "---:|" * (8 + len(shown) + len(ratios)))
    for r in rows:
        res = r["results"]
        tps = {c: res[c][0].tokens_per_s for c in configs}
        war = res["war"][0] if "war" in res else None
        print(f"| {r['per_replica']} | {r['trajectories']} | {r['tokens']} | "
              + " | ".join(f"{tps[c]:.0f}" for c in shown) + " | "
              + " | ".join(f"{tps[a] / tps[b]:.2f}x" for a, b in ratios) + " | "
              + (f"{war.verify_steps / war.steps:.0%}" if war else "-") + " | "
              + " / ".join(f"{res[c][0].hit_rate:.0%}" for c in kv) + " | "
              + " / ".join(f"{res[c][0].recomputed_tokens / 1000:.0f}" for c in kv) + " | "
              + " / ".join(f"{res[c][0].preemptions}" for c in kv)
              + f" | {sum(w for _, w in res.values()):.0f} |", flush=True)


def plot_sweep(rows: list[dict], configs: Sequence[str], title: str, path: str) -> None:
    from talaria_jax.launch.sweep import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["per_replica"] for r in rows]
    for c in configs:
        if c != "baseline":
            ax.plot(x, [r["results"][c][0].tokens_per_s / r["results"]["baseline"][0].tokens_per_s for r in rows],
                    marker="o", label=c)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("trajectories per replica")
    ax.set_ylabel("rollout tokens/s over the baseline")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    unknown = [c for c in _CONFIGS.value if c not in CONFIGS]
    if unknown:
        raise app.UsageError(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    turns = tuple(int(x) for x in _TURNS.value)
    if len(turns) != 2 or not 1 <= turns[0] <= turns[1]:
        raise app.UsageError(f"--turns must be min,max with 1 <= min <= max, got {_TURNS.value}")
    sweep = [int(x) for x in _SWEEP.value or ()]
    if any(v < 1 for v in sweep):
        raise app.UsageError(f"--sweep: trajectories per replica must be >= 1, got {_SWEEP.value}")
    if (sweep or _SWEEP_PLOT.value) and ("baseline" not in _CONFIGS.value or _TRAJECTORIES.value):
        raise app.UsageError("--sweep needs the baseline among --configs and a generated step (no --trajectories)")
    from talaria_jax.rollout.replay import ReplicaShape, agentic_step, read_jsonl, synthetic_step
    from talaria_jax.sim.hardware import ConfigError, load_hardware, load_models

    try:
        hw = load_hardware(_HARDWARE.value)
        models = load_models(tp=hw.num_gpus)
    except (ConfigError, FileNotFoundError) as e:
        raise app.UsageError(f"--hardware: {e}") from None
    if _MODEL.value not in models:
        raise app.UsageError(f"--model: unknown {_MODEL.value!r}; known: {', '.join(models)}")
    shape = ReplicaShape(hw, models[_MODEL.value], max_seqs=_MAX_SEQS.value, max_tokens_per_step=_STEP_TOKENS.value,
                         kv_tokens=_KV_TOKENS.value, host_kv_tokens=_HOST_KV.value)

    def generate(prompts: int):
        if _WORKLOAD.value == "agentic":
            return agentic_step(prompts, _SAMPLES.value, tool_scale=_TOOL_SCALE.value, repetition=_REPETITION.value,
                                seed=_SEED.value)
        return synthetic_step(prompts, _SAMPLES.value, turns=turns, prompt_tokens=_PROMPT_TOKENS.value,
                              output_tokens=_OUTPUT_TOKENS.value, output_sigma=_OUTPUT_SIGMA.value,
                              max_output=_MAX_OUTPUT.value, observation_tokens=_OBSERVATION.value,
                              tool_s=_TOOL_S.value, repetition=_REPETITION.value, seed=_SEED.value)

    where = f"{_REPLICAS.value} x {hw.name} replicas of {_MODEL.value} ({_MAX_SEQS.value} slots each)"
    if sweep:
        print(f"A load sweep on {where}", flush=True)
        rows = []
        for v in sweep:
            trajs = generate(max(1, round(v * _REPLICAS.value / _SAMPLES.value)))
            runs = replay_configs(trajs, shape, _REPLICAS.value, _CONFIGS.value, _SPEC.value, _PER_HOST.value,
                                  _DRAFTER.value)
            rows.append(dict(per_replica=v, trajectories=len(trajs), tokens=sum(t.output_tokens for t in trajs),
                             results={name: (res, wall) for name, res, wall in runs}))
            print(f"  {v} per replica: {len(trajs)} trajectories, replayed in "
                  f"{sum(w for _, w in rows[-1]['results'].values()):.0f} s", flush=True)
        print_sweep(rows, _CONFIGS.value)
        if _SWEEP_PLOT.value:
            plot_sweep(rows, _CONFIGS.value, where, _SWEEP_PLOT.value)
            print(f"wrote {_SWEEP_PLOT.value}")
        return
    trajs = read_jsonl(_TRAJECTORIES.value) if _TRAJECTORIES.value else generate(_PROMPTS.value)
    tokens = sum(t.output_tokens for t in trajs)
    print(f"{len(trajs)} trajectories, {sum(len(t.turns) for t in trajs)} turns, {tokens} output tokens, on {where}",
          flush=True)
    results = print_step(replay_configs(trajs, shape, _REPLICAS.value, _CONFIGS.value, _SPEC.value, _PER_HOST.value,
                                        _DRAFTER.value))
    if _PLOT.value:
        plot_timelines({name: res for name, (res, _) in results.items()}, _PLOT.value)
        print(f"wrote {_PLOT.value}")


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
