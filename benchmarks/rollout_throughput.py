"""Rollout tokens/s of WAR against data-parallel rollouts, on live multi-turn agentic trajectories.

Each trajectory is SmolLM2-135M-Instruct working one of the toy repositories of
`talaria_jax.rollout.agent_env` through its bash-like tool, turn after turn (the tool's output is the
next turn's message), with several sibling trajectories per task (a GRPO group: same first prompt,
other seeds). A synchronous RL step is one `RolloutService.rollout` call over all of them; its
rollout throughput is the model tokens it generated over its wall time. Side by side, on the same
replicas' configuration:

  war       suffix-tree speculation (the per-step policy: drafts only where they pay) and
            cache-aware placement (trajectories stay where their KV is; the tail is admitted first)
  baseline  the same engines with no speculation and round-robin placement
  (--ablation adds spec_only and placement_only)

at a low load (a few trajectories per replica) and a high load (more trajectories than the
replicas' batch slots). The service draws every sample with its own seed, so all configurations
generate the same tokens (checked), and every engine has prefix caching on.

  .venv/bin/python -m benchmarks.rollout_throughput                      # 2 replicas x 1 device
  .venv/bin/python -m benchmarks.rollout_throughput --devices_per_replica=4 --loads=low

`--tunix` times something else: one GRPO step's rollout inside Tunix (`BaseRollout.generate` of
`--tunix_prompts` questions x `--tunix_group` samples, as Tunix's GRPO learner calls it) with
talaria's engine (rollout/tunix_rollout.py, `--replicas` engines) against Tunix's vanilla sampler
on the same devices, the same weights (a random Tunix Llama3 of SmolLM2-135M's shapes) and the same
prompts, interleaved, best of `--tunix_runs`.
"""
from __future__ import annotations

import gc
import json
import os
import time

from absl import app, flags

from benchmarks import common
from talaria_jax.rollout import agent_env

_REPLICAS = flags.DEFINE_integer("replicas", 2, "Rollout replicas.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_replica", 1, "Devices of each replica's mesh (TP degree).", lower_bound=1)
_LOADS = flags.DEFINE_list("loads", ["low", "high"], "Loads to run: low, high.")
_LOW = flags.DEFINE_list("low", ["2", "2"], "Low load: tasks, samples per task.")
_HIGH = flags.DEFINE_list("high", ["8", "4"], "High load: tasks, samples per task.")
_MAX_SEQS = flags.DEFINE_integer("max_seqs", 8, "Batch slots per replica.", lower_bound=1)
_MAX_TURNS = flags.DEFINE_integer("max_turns", 4, "Model turns per trajectory at most.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 96, "Tokens per reply at most.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature.", lower_bound=0.0)
_SPEC = flags.DEFINE_integer("max_spec_tokens", 8, "WAR's draft tokens per request and step at most.", lower_bound=1)
_KV_MIB = flags.DEFINE_integer("kv_mib", 1024, "KV pool of each replica, MiB per device.", lower_bound=64)
_ABLATION = flags.DEFINE_bool("ablation", False, "Also run speculation alone and placement alone.")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")
_SIMULATE = flags.DEFINE_bool("simulate", True, "Also replay each load's trajectories on the simulator "
                              "(rollout/replay.py, --hardware's profile) and print its prediction of every "
                              "configuration beside the measurement.")
_HARDWARE = flags.DEFINE_string("hardware", "cpu_rollout", "--simulate: the hardware profile (talaria-calibrate "
                                 "--engine=rollout's: this machine's replica engine, and its replicas sharing its cores).")
_RECORD = flags.DEFINE_string("record_dir", None, "Write each load's trajectories here as JSONL "
                              "(<load>.jsonl, talaria-rollout-replay --trajectories).")
_RESIMULATE = flags.DEFINE_string("resimulate", None, "Measure nothing: replay the trajectories of a run's "
                                  "--record_dir on the simulator (--hardware) against the measurements of its "
                                  "--out JSON, this file.")
_TUNIX = flags.DEFINE_bool("tunix", False, "Time one GRPO step's rollout in Tunix: talaria's engine vs vanilla.")
_TUNIX_PROMPTS = flags.DEFINE_integer("tunix_prompts", 8, "--tunix: questions per GRPO step.", lower_bound=1)
_TUNIX_GROUP = flags.DEFINE_integer("tunix_group", 8, "--tunix: samples per question.", lower_bound=1)
_TUNIX_RUNS = flags.DEFINE_integer("tunix_runs", 3, "--tunix: interleaved runs; the best of each is shown.",
                                   lower_bound=1)

PAPER = {"low": 1.4, "high": 1.6}  # WAR's rollout-throughput gains (DESIGN.md)
CONFIGS = {"war": (True, "cache_aware"), "baseline": (False, "round_robin"), "spec_only": (True, "round_robin"),
           "placement_only": (False, "cache_aware")}


def engine_config(speculate: bool, warmup: bool = True):
    from talaria_jax.engine import EngineConfig
    from talaria_jax.rollout import SpecConfig

    spec = SpecConfig(max_spec_tokens=_SPEC.value) if speculate else None
    k1 = _SPEC.value + 1 if speculate else 1
    return EngineConfig(max_seqs=_MAX_SEQS.value, max_tokens_per_step=max(256, _MAX_SEQS.value * k1),
                        max_model_len=agent_env.MAX_MODEL_LEN, kv_memory_bytes_per_device=_KV_MIB.value << 20,
                        prefix_cache=True, speculation=spec, warmup=warmup)


def build(speculate: bool, placement: str):
    from talaria_jax.rollout import ReplicaSpec, RolloutService

    cfg = engine_config(speculate)
    d = _DEVICES.value
    replicas = [ReplicaSpec(agent_env.MODEL, devices=tuple(range(i * d, (i + 1) * d)), dtype="float32", engine=cfg,
                            compilation_cache=None).build() for i in range(_REPLICAS.value)]
    if speculate:
        for r in replicas:
            r.engine.spec_policy()  # measure the step-cost curve now, not inside the timed rollout
    return RolloutService(replicas, placement, seed=0), replica_shape(replicas[0].engine)


def run(name: str, tasks, tokenizer, samples: int):
    from talaria_jax.engine import SamplingParams

    t0 = time.perf_counter()
    service, shape = build(*CONFIGS[name])
    print(f"  {name}: replicas built and warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
    make_env, rewards = agent_env.env_factory(tasks, tokenizer)
    prompts = [agent_env.first_prompt(tokenizer, t) for t in tasks]
    params = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=_TEMPERATURE.value)
    t0 = time.perf_counter()
    trajs = service.rollout(prompts, make_env, params, n=samples, max_turns=_MAX_TURNS.value)
    secs = time.perf_counter() - t0
    stats = service.stats()
    service.close()
    reps = stats["replicas"]
    spec_steps, steps = sum(r["spec_steps"] for r in reps), sum(r["steps"] for r in reps)
    query = sum(r["prefix_query_tokens"] for r in reps)
    out = dict(config=name, seconds=secs, tokens=stats["generated_tokens"], tok_s=stats["generated_tokens"] / secs,
               prefill_tokens=sum(r["prefill_tokens"] for r in reps), cached_tokens=stats["cached_tokens"],
               spec_share=spec_steps / steps if steps else 0.0,
               hit_rate=sum(r["prefix_hit_tokens"] for r in reps) / query if query else 0.0,
               preemptions=sum(r["preemptions"] for r in reps),
               evicted_pages=sum(r["prefix_evicted_pages"] for r in reps),
               accepted_per_spec_step=sum(r["accepted_tokens"] for r in reps) / spec_steps if spec_steps else None,
               turns=sum(len(t.turns) for g in trajs for t in g), solved=sum(v == 1.0 for v in rewards.values()),
               ids=[t.token_ids for g in trajs for t in g], trajs=trajs, shape=shape)
    print(f"  {name}: {out['tokens']} tokens in {secs:.1f} s = {out['tok_s']:.1f} tok/s; prefilled "
          f"{out['prefill_tokens']}, cached {out['cached_tokens']} (hit rate {out['hit_rate']:.0%}, "
          f"{out['evicted_pages']} cached pages evicted, {out['preemptions']} preemptions); speculated "
          f"{out['spec_share']:.0%} of steps", flush=True)
    del service
    gc.collect()
    return out


def replica_shape(e):
    """The simulator's view of a replica of engine `e`: --hardware's profile, the served model's shape,
    the engine's limits, KV and, on the jnp reference attention, how its runner lays out a step."""
    from talaria_jax.rollout.replay import ReplicaShape
    from talaria_jax.sim.hardware import ModelShape, load_hardware

    cfg = e.model.cfg
    return ReplicaShape(load_hardware(_HARDWARE.value), ModelShape.from_config(cfg, cfg.weight_dtype, _DEVICES.value),
                        max_seqs=e.config.max_seqs, max_tokens_per_step=e.config.max_tokens_per_step,
                        page_size=e.page_size, kv_tokens=e.pool_spec.num_slots,
                        tiles=e.runner.reference_tiles)


def simulate(load: str, records, measured: dict, shapes: dict) -> list[dict]:
    """Each configuration's step replayed on the simulator from the trajectories the run generated
    (the same in every configuration), beside what was measured (`run`'s dict per configuration),
    on replicas of `shapes[name]`."""
    from talaria_jax.rollout import SpecConfig
    from talaria_jax.rollout.replay import replay_step

    rows = []
    for name, r in measured.items():
        speculate, placement = CONFIGS[name]
        res = replay_step(records, shapes[name], _REPLICAS.value, placement,
                          SpecConfig(max_spec_tokens=_SPEC.value) if speculate else None,
                          replicas_per_host=_REPLICAS.value)  # all on this machine's cores
        rows.append(dict(load=load, config=name, measured=r["tok_s"], simulated=res.tokens_per_s,
                         error=res.tokens_per_s / r["tok_s"] - 1, measured_s=r["seconds"], simulated_s=res.step_s,
                         prefill=f"{res.prefill_tokens} / {r['prefill_tokens']}",
                         hits=f"{res.hit_rate:.0%} / {r['hit_rate']:.0%}" if "hit_rate" in r else f"{res.hit_rate:.0%} / -",
                         preempted=f"{res.preemptions} / {r['preemptions']}" if "preemptions" in r else f"{res.preemptions} / -",
                         spec=f"{res.verify_steps / res.steps:.0%} / {r['spec_share']:.0%}" if speculate else "-"))
    return rows


def resimulate(path: str) -> list[dict]:
    """--resimulate: a measured run's rows and trajectories on the simulator, with each
    configuration's replica shape from an engine of its configuration (built without warming up)."""
    import jax

    from talaria_jax.engine.engine import Engine
    from talaria_jax.rollout.replay import read_jsonl
    from talaria_jax.sharding import make_mesh
    from talaria_jax.weights import load_model

    with open(path) as f:
        rows = json.load(f)["rows"]
    model = load_model(agent_env.MODEL, make_mesh(jax.devices()[:_DEVICES.value]), dtype="float32").model
    shape = {s: replica_shape(Engine(model, engine_config(s, warmup=False))) for s in (False, True)}
    out = []
    for row in rows:
        records = read_jsonl(os.path.join(_RECORD.value or ".", f"{row['load']}.jsonl"))
        out += simulate(row["load"], records, row["results"],
                        {name: shape[CONFIGS[name][0]] for name in row["results"]})
    return out


def print_simulated(sim_rows: list[dict]) -> None:
    print(f"\nThe simulator (rollout/replay.py on the {_HARDWARE.value!r} profile) on the same trajectories:\n")
    common.print_markdown_table(
        [("load", "load", ""), ("config", "config", ""), ("measured tok/s", "measured", ".1f"),
         ("simulated tok/s", "simulated", ".1f"), ("error", "error", "+.0%"), ("measured s", "measured_s", ".1f"),
         ("simulated s", "simulated_s", ".1f"), ("prefill tokens sim / measured", "prefill", ""),
         ("prefix hits sim / measured", "hits", ""), ("preemptions sim / measured", "preempted", ""),
         ("steps speculated sim / measured", "spec", "")], sim_rows)


def tunix_step() -> None:
    """--tunix: see the module docstring."""
    import sys

    import jax
    from flax import nnx
    from tunix.models.llama3 import model as llama3
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    from talaria_jax.rollout.tunix_rollout import TalariaRollout

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import tunix_grpo

    # SmolLM2-135M's shapes (configs/models/smollm2-135m.yaml), random weights
    cfg = llama3.ModelConfig(num_layers=30, vocab_size=49152, embed_dim=576, hidden_dim=1536, num_heads=9, head_dim=64,
                             num_kv_heads=3, rope_theta=100_000, norm_eps=1e-5, weight_tying=True)
    model = tunix_grpo.randomize(llama3.Llama3(cfg, rngs=nnx.Rngs(0)), seed=0, scale=0.02)
    tok = tunix_grpo.CharTokenizer()
    prompts = [q for q in tunix_grpo.questions(0, _TUNIX_PROMPTS.value) for _ in range(_TUNIX_GROUP.value)]
    rc = base_rollout.RolloutConfig(max_tokens_to_generate=_MAX_TOKENS.value, max_prompt_length=32,
                                    kv_cache_size=32 + _MAX_TOKENS.value, temperature=_TEMPERATURE.value, top_p=1.0,
                                    return_logprobs=True)
    d = _DEVICES.value * _REPLICAS.value
    mesh = jax.make_mesh((1, d), ("fsdp", "tp"), devices=jax.devices()[:d],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    t0 = time.perf_counter()
    engines = {"talaria": TalariaRollout(model, tok, mesh, rc, replicas=_REPLICAS.value, max_seqs=_MAX_SEQS.value),
               "vanilla": vanilla_rollout.VanillaRollout(model, tok, base_rollout.CacheConfig(
                   rc.kv_cache_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim))}
    print(f"tunix: {len(prompts)} rollouts ({_TUNIX_PROMPTS.value} questions x {_TUNIX_GROUP.value}) of up to "
          f"{_MAX_TOKENS.value} tokens, a random Llama3 of SmolLM2-135M's shapes; engines built in "
          f"{time.perf_counter() - t0:.0f} s (load average {os.getloadavg()[0]:.2f})", flush=True)
    times = {name: [] for name in engines}
    tokens = {}
    for run in range(_TUNIX_RUNS.value + 1):  # run 0 compiles, not counted
        for name, engine in engines.items():
            t = time.perf_counter()
            out = engine.generate(prompts, rc)
            secs = time.perf_counter() - t
            tokens[name] = sum(len(x) for x in out.tokens)
            if run:
                times[name].append(secs)
            print(f"  run {run}{' (compiles)' if not run else ''} {name}: {secs:.2f} s, {tokens[name]} tokens",
                  flush=True)
    engines["talaria"].close()
    rows = [dict(engine=name, best=min(t), tokens=tokens[name], tok_s=tokens[name] / min(t),
                 runs=", ".join(f"{x:.2f}" for x in t)) for name, t in times.items()]
    print()
    common.print_markdown_table([("rollout engine", "engine", ""), ("best s", "best", ".2f"), ("runs s", "runs", ""),
                                 ("tokens", "tokens", "d"), ("tok/s", "tok_s", ".1f")], rows)
    print(f"\nvanilla / talaria time: {min(times['vanilla']) / min(times['talaria']):.2f}x; "
          f"load average after: {os.getloadavg()[0]:.2f}")


def main(argv):
    del argv
    from absl import logging

    from talaria_jax.sharding import simulate_cpu_devices

    simulate_cpu_devices(_REPLICAS.value * _DEVICES.value)  # one simulated device per replica rank

    logging.set_verbosity(logging.WARNING)
    if _TUNIX.value:
        return tunix_step()
    from talaria_jax.engine import enable_compilation_cache
    from talaria_jax.tokenizer import load_tokenizer
    from talaria_jax.weights.named import resolve

    if _RESIMULATE.value:
        return print_simulated(resimulate(_RESIMULATE.value))
    from talaria_jax.rollout.replay import records_of, write_jsonl

    enable_compilation_cache()
    tokenizer = load_tokenizer(resolve(agent_env.MODEL)[1])
    names = ["war", "baseline"] + (["spec_only", "placement_only"] if _ABLATION.value else [])
    rows, sim_rows = [], []
    for load in _LOADS.value:
        if load not in PAPER:
            raise app.UsageError(f"--loads: unknown {load!r}; known: low, high")
        n_tasks, samples = (int(x) for x in (_LOW if load == "low" else _HIGH).value)
        tasks = list(agent_env.TASKS.values())[:n_tasks]
        print(f"{load} load: {n_tasks} tasks x {samples} samples = {n_tasks * samples} trajectories on "
              f"{_REPLICAS.value} replicas x {_MAX_SEQS.value} slots (load average {os.getloadavg()[0]:.2f})", flush=True)
        results = {name: run(name, tasks, tokenizer, samples) for name in names}
        same = all(r["ids"] == results["baseline"]["ids"] for r in results.values())
        records = records_of(results["baseline"].pop("trajs"))
        if _RECORD.value:
            os.makedirs(_RECORD.value, exist_ok=True)
            write_jsonl(records, os.path.join(_RECORD.value, f"{load}.jsonl"))
        shapes = {name: r.pop("shape") for name, r in results.items()}
        for r in results.values():
            for k in ("ids", "trajs"):
                r.pop(k, None)
        if _SIMULATE.value:
            sim_rows += simulate(load, records, results, shapes)
        base = results["baseline"]["tok_s"]
        row = dict(load=load, trajectories=n_tasks * samples, turns=results["war"]["turns"],
                   tokens=results["war"]["tokens"], same_tokens=same, paper=PAPER[load],
                   **{f"{k}_tok_s": r["tok_s"] for k, r in results.items()},
                   **{f"{k}_ratio": r["tok_s"] / base for k, r in results.items() if k != "baseline"},
                   war_cached=results["war"]["cached_tokens"], baseline_cached=results["baseline"]["cached_tokens"],
                   war_spec_share=results["war"]["spec_share"], results=results)
        rows.append(row)
    cols = [("load", "load", ""), ("trajectories", "trajectories", "d"), ("turns", "turns", "d"),
            ("tokens", "tokens", "d"), ("baseline tok/s", "baseline_tok_s", ".1f"), ("WAR tok/s", "war_tok_s", ".1f"),
            ("WAR / baseline", "war_ratio", ".2f"), ("paper", "paper", ".1f")]
    if _ABLATION.value:
        cols += [("spec only", "spec_only_ratio", ".2f"), ("placement only", "placement_only_ratio", ".2f")]
    cols += [("WAR steps speculated", "war_spec_share", ".0%"), ("cached tokens WAR / baseline", "cached", ""),
             ("same tokens", "same_tokens", "")]
    for r in rows:
        r["cached"] = f"{r['war_cached']} / {r['baseline_cached']}"
    print()
    common.print_markdown_table(cols, rows)
    if _SIMULATE.value:
        print_simulated(sim_rows)
    print(f"\n{common.load_after()}")
    common.write_json(_OUT.value, {"rows": rows, "simulated": sim_rows})


if __name__ == "__main__":
    app.run(main)
