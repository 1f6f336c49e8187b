"""talaria-calibrate: measure this machine's real engine and write the simulator's hardware profile.

    python -m talaria_jax.launch.calibrate --out=configs/hardware/cpu.yaml

Builds one real instance (``talaria_jax.instance``) hosting the local replay's models, times decode
and prefill steps, a weight switch from pinned host memory and from the staging area, and a session's
KV offload and restore, and decode steps while another model's staging copy is in flight
(``talaria_jax.calibration``), fits the cost model's rates, prints every measured
point next to the fitted cost model's prediction, and writes the profile. `talaria-replay
--backend=local --hardware=<the profile>` then predicts a local replay with it.

`--engine=rollout` times the steps of rollout replicas' engines instead (the engine
`benchmarks/rollout_throughput.py` runs: 8 slots, 256 tokens a step, a 3,072-token context, the
prefix cache): decode steps and prefill steps, fresh and after a prefix-cache hit
(``attention_efficiency``), steps verifying suffix drafts (``verify_token_overhead_us``), at the
contexts `--contexts` and `--verify_contexts` name, and how much slower a step is while two replicas on this host step
at once (``colocated_step_slowdown``, decode and prefill shapes). The fit prices every step as the engine's
runner lays it out (``tile_walk_efficiency``). `benchmarks/rollout_throughput.py` checks the rollout
simulator with the profile it writes:

    python -m talaria_jax.launch.calibrate --engine=rollout --models=smollm2-135m-instruct --steps=12 \
        --out=configs/hardware/cpu_rollout.yaml
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
import platform
import sys
from typing import Sequence

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["smollm2-135m-instruct", "tiny-dense", "tiny-moe"], "Models to time (as talaria-replay --backend=local hosts them).")
flags.DEFINE_integer("devices_per_instance", 1, "Devices (TP) of the instance measured.")
flags.DEFINE_string("out", "configs/hardware/cpu.yaml", "Where to write the profile.")
flags.DEFINE_string("weight_budget", "largest", "The instance's weights, as talaria-replay --backend=local "
                    "(--local_weight_budget) and make demo serve them: 'largest' or a number of bytes (models in "
                    "arrays of their own under that budget), or 'slot' (one weight slot the models share). Not "
                    "'all': with every model resident there is no switch to time.")
flags.register_validator("weight_budget", lambda v: v == "slot" or v == "largest" or (v.isdigit() and int(v) > 0),
                         "must be 'largest', a number of bytes or 'slot'")
flags.DEFINE_integer("steps", 6, "Decode steps timed per point (the median is kept).")
flags.DEFINE_list("contexts", ["256", "1024", "2048", "2752"], "--engine=rollout: the contexts (tokens) of the "
                  "decode steps timed, at batches 1, 4 and 8, and (past the first) of the prefix-cache hits that "
                  "prefill steps follow; cover the contexts the rollouts reach (at most 2,880).")
flags.DEFINE_list("verify_contexts", ["512", "1024", "2048"], "--engine=rollout: the contexts of the steps verifying "
                  "drafts timed.")
for _name in ("contexts", "verify_contexts"):
    flags.register_validator(_name, lambda v: all(x.isdigit() and int(x) % 16 == 0 and 16 <= int(x) <= 2880
                                                  for x in v),
                             "must be token counts from 16 to 2880 in whole 16-token pages (8 sequences of it "
                             "and the steps timed fit the rollout engine's 1 GiB of KV)")
flags.DEFINE_enum("engine", "instance", ["instance", "rollout"], "Whose steps to time: a Talaria instance's, or "
                  "two rollout replicas' engines on this host (with the slowdown when both step at once).")
# benchmarks/rollout_throughput.py's replica engine (its default flags)
ROLLOUT_ENGINE = dict(max_seqs=8, max_tokens_per_step=256, max_model_len=3072, kv_memory_bytes_per_device=1 << 30,
                      prefix_cache=True, warmup=False)


def rollout_points(models: Sequence[str], devices: int) -> tuple[list, float, object]:
    """Step points of a rollout replica's engine for each of `models`, the colocated slowdown of two
    replicas of the first (`devices` each) on this host, and how its runner lays out a step where its
    attention is the jnp reference (the rollout replay prices steps by it), else None."""
    import jax

    from talaria_jax import calibration
    from talaria_jax.engine.engine import Engine, EngineConfig
    from talaria_jax.engine.spec import SpecConfig
    from talaria_jax.sharding import make_mesh
    from talaria_jax.weights import load_model

    points, colocated, tiles = [], 1.0, None
    for i, m in enumerate(models):
        engines = [Engine(load_model(m, make_mesh(jax.devices()[r * devices:(r + 1) * devices]), dtype="float32").model,
                          EngineConfig(**ROLLOUT_ENGINE)) for r in range(2)]
        print(f"timing {m}'s rollout engine ...", file=sys.stderr)
        points += calibration.measure_engine(engines[0], m, batches=(1, 4, 8), contexts=tuple(map(int, FLAGS.contexts)),
                                           pasts=tuple(c for c in sorted(map(int, FLAGS.contexts))[1:]  # that fit
                                                       if c + 256 < ROLLOUT_ENGINE["max_model_len"]),
                                           prompts=(16, 64, 256), steps=FLAGS.steps)
        spec = Engine(engines[0].model, EngineConfig(**ROLLOUT_ENGINE, speculation=SpecConfig(max_spec_tokens=8,
                                                                                             policy="always")))
        for context in map(int, FLAGS.verify_contexts):
            points += calibration.measure_verify(spec, m, batches=(1, 2, 4, 8), context=context, steps=FLAGS.steps)
        del spec
        if i == 0:
            tiles = engines[0].runner.reference_tiles
            r = calibration.measure_colocated(engines, steps=FLAGS.steps)
            colocated = r["slowdown"]
            for c in r["shapes"]:
                what = (f"decode, batch {c['batch']}, context {c['tokens']:,}" if c["kind"] == "decode"
                        else f"prefill of {c['tokens']:,} tokens")
                print(f"step of {m} ({what}): {c['step_alone_s'] * 1e3:.1f} ms alone, {c['step_together_s'] * 1e3:.1f} ms "
                      f"while another replica steps ({c['slowdown']:.2f}x, the median of its paired reps)")
            print(f"colocated_step_slowdown: {colocated:.2f} (the median over every shape's reps)")
    return points, colocated, tiles


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from talaria_jax import calibration
    from talaria_jax.sharding import simulate_cpu_devices

    rollout = FLAGS.engine == "rollout"
    simulate_cpu_devices(FLAGS.devices_per_instance * (2 if rollout else 1))
    from talaria_jax.engine.engine import EngineConfig
    from talaria_jax.instance import SessionTokens, build_instances
    from talaria_jax.sim.hardware import load_hardware

    hw0 = dataclasses.replace(load_hardware("h200x8"), num_gpus=FLAGS.devices_per_instance)  # estimates unused here
    ec = EngineConfig(max_seqs=8, max_tokens_per_step=256, max_model_len=1040, warmup=False)
    inst = build_instances(FLAGS.models, hw0, instances=1, devices_per_instance=FLAGS.devices_per_instance,
                           engine_config=ec, tokens=SessionTokens(), weight_budget=FLAGS.weight_budget)[0]
    if inst.slot is None and inst.weights is None:
        raise app.UsageError(f"--weight_budget={FLAGS.weight_budget} holds every model of --models at once: "
                             f"no weight copy to time; give more models or a smaller budget")
    points, colocated, tiles = [], 1.0, None
    if rollout:
        points, colocated, tiles = rollout_points(FLAGS.models, FLAGS.devices_per_instance)
    for m in [] if rollout else FLAGS.models:
        print(f"timing {m} ...", file=sys.stderr)
        points += calibration.measure_model(inst, m, steps=FLAGS.steps)
    size = {m: s.weight_bytes for m, s in inst.shapes().items()}
    biggest = max(FLAGS.models, key=size.get)
    copies = calibration.measure_copies(inst, biggest)
    staging = []
    w = inst.weights
    beside = lambda m, o: w is None or w.nbytes(m) + w.nbytes(o) <= w.budget_bytes
    if len(FLAGS.models) > 1 and not rollout:  # each model decoding while the biggest other one that fits stages
        by_size = sorted(FLAGS.models, key=size.get, reverse=True)
        for m in FLAGS.models:
            other = next((o for o in by_size if o != m and beside(m, o)), None)
            if other is None:
                print(f"{m}: no other model fits the weight budget beside it (nothing stages while it serves)",
                      file=sys.stderr)
                continue
            print(f"timing {m} while {other} stages ...", file=sys.stderr)
            staging.append((m, other, calibration.measure_staging(inst, m, other, steps=FLAGS.steps)))
    hw = calibration.fit(points, copies, inst, name=pathlib.Path(FLAGS.out).stem, staging=[r for _, _, r in staging],
                       colocated=colocated, tiles=tiles)
    print("| model | kind | batch | tokens | measured (ms) | cost model (ms) | error |\n|---|---|---:|---:|---:|---:|---:|")
    for p, pred in calibration.predicted(hw, inst, points, tiles):
        kind = (f"{p.kind} ({p.drafted:.1f} drafts)" if p.kind == "verify"
                else f"{p.kind} (after {p.past} cached)" if p.past else p.kind)
        print(f"| {p.model} | {kind} | {p.batch} | {p.tokens} | {p.seconds * 1e3:.1f} | {pred * 1e3:.1f} "
              f"| {pred / p.seconds - 1:+.0%} |")
    print(f"\nweights ({copies['weight_bytes'] / 1e6:.0f} MB of {biggest}): load from pinned host "
          f"{copies['weight_load_s'] * 1e3:.1f} ms, staged switch (D2D) {copies['d2d_s'] * 1e3:.1f} ms; KV "
          f"({copies['kv_bytes'] / 1e6:.1f} MB): offload {copies['kv_offload_s'] * 1e3:.1f} ms, restore "
          f"{copies['kv_restore_s'] * 1e3:.1f} ms")
    for m, other, r in staging:
        print(f"decode step of {m}: {r['step_idle_s'] * 1e3:.1f} ms idle, {r['step_staging_s'] * 1e3:.1f} ms while "
              f"{other} stages ({r['slowdown']:.2f}x, {r['staging_copies']:.0f} copies)")
    print(f"staging_step_slowdown: {hw.staging_step_slowdown:.3g} (mean ratio, at least 1)")
    whose = "rollout replica" if rollout else "instance"
    given = "".join(f" --{k}={','.join(FLAGS[k].value)}" for k in ("contexts", "verify_contexts")
                    if rollout and FLAGS[k].present)
    tiled = ("Steps are priced as the runner lays them out (its query tiles, sim.cost.CostModel.tiles), as\n"
             "benchmarks/rollout_throughput.py's replay prices them on this profile: the step's KV read once\n"
             "(kv_bw_efficiency) and each tile's walk over the keys it visits (tile_walk_efficiency of the\n"
             "weights' rate), fitted to every point at once, compute and memory times added.\n" if tiles else "")
    header = (f"Measured by talaria-calibrate on {datetime.date.today()} ({platform.machine()}, {os.cpu_count()} CPUs,\n"
              f"{FLAGS.devices_per_instance} simulated device(s) per {whose}; models {', '.join(FLAGS.models)};\n"
              f"weights: {'one slot' if FLAGS.weight_budget == 'slot' else 'own arrays, budget ' + FLAGS.weight_budget}).\n"
              f"Rates are effective ones (efficiencies 1, but kv_bw_efficiency: the KV reads' share of the weights'\n"
              f"rate, and attention_efficiency: prefill attention's share of the matmul rate); step_overhead_us\n"
              f"is the fitted fixed cost of a step; compute_memory_overlap 1 or 0: a step takes the longer of its\n"
              f"compute and memory times, or their sum (whichever fitted better{'; with tiles, their sum' if tiles else ''});\n"
              f"verify_token_overhead_us is what each token of a step verifying drafts takes beyond a prefill token;\n"
              f"staging_step_slowdown is a decode step's time with another model staging over its idle time.\n"
              f"colocated_step_slowdown is a step's time while another replica steps over its time alone.\n"
              f"{tiled}"
              f"Regenerate: python -m talaria_jax.launch.calibrate"
              f"{' --engine=rollout --models=' + ','.join(FLAGS.models) if rollout else ''}"
              f"{f' --steps={FLAGS.steps}' if FLAGS['steps'].present else ''}"
              f"{given}"
              f" --out={FLAGS.out}")
    path = pathlib.Path(FLAGS.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(calibration.to_yaml(hw, header))
    print(f"wrote {path}", file=sys.stderr)


def run() -> None:
    """Console-script entry point (talaria-calibrate)."""
    app.run(main)


if __name__ == "__main__":
    run()
