"""Rollout tokens/s with and without suffix-tree speculation, on recorded agentic trajectories.

The workload is `benchmarks/data/agent_trajectories.json` (multi-turn trajectories of
SmolLM2-135M-Instruct in the toy repositories of `talaria_jax.rollout.agent_env`, several siblings
per task): every turn is a request (its recorded prompt, its recorded length, the recorded seed and
temperature), in the order a synchronous RL loop issues them (turn by turn, siblings side by side).
For each batch size B the requests run in waves of B concurrent requests through three engines on
the same weights:

  plain   no speculation
  always  suffix drafts of up to --max_spec_tokens tokens at every step
  auto    the policy (engine/spec/policy.py): drafts per step from the measured step-cost curve

rep by rep (each wave on all three before the next), best of --reps per wave. Each batch size
starts the speculating engines with empty suffix trees. The outputs of all three must be equal
(seeded sampling draws the same tokens with or without drafts); the table gives tokens/s, the
ratios to plain, the tokens accepted per speculative step and the policy's drafts at that batch.

  .venv/bin/python -m benchmarks.spec_decode                     # batches 1, 4, 16, 64
  .venv/bin/python -m benchmarks.spec_decode --batches=1,4 --out=/tmp/spec.json
"""
from __future__ import annotations

import os
import time

from absl import app, flags

from benchmarks import common
from talaria_jax.rollout import agent_env

_BATCHES = flags.DEFINE_list("batches", ["1", "4", "16", "64"], "Concurrent requests per wave.")
_REQUESTS = flags.DEFINE_integer("min_requests", 8, "Requests per batch size at least (waves of B: max(B, this)).")
_SPEC = flags.DEFINE_integer("max_spec_tokens", 8, "Draft tokens per request and step at most.")
_TREE = flags.DEFINE_bool("tree", False, "Tree drafts instead of chains.")
_REPS = flags.DEFINE_integer("reps", 1, "Timed runs of each wave per engine (best of).")
_DATA = flags.DEFINE_string("data", str(common.TRAJECTORIES), "Recorded trajectories.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature (the recording's: 0.8).")
_KV_MIB = flags.DEFINE_integer("kv_mib", agent_env.KV_BYTES >> 20, "KV pool of each engine (MiB).")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def requests(trajectories):
    """(prompt, max_tokens, seed) of every recorded turn: turn by turn, each task's siblings together."""
    order = sorted(trajectories, key=lambda t: (t.task, t.sibling))
    depth = max(len(t.turns) for t in order)
    return [(u.prompt, len(u.response), t.seed + k) for k in range(depth) for t in order if k < len(t.turns)
            for u in [t.turns[k]]]


def build(model, tokenizer, max_seqs: int, spec):
    from talaria_jax.engine import Engine, EngineConfig

    k1 = spec.max_spec_tokens + 1 if spec is not None else 1
    return Engine(model, EngineConfig(max_seqs=max_seqs, max_tokens_per_step=max(256, max_seqs * k1),
                                      max_model_len=agent_env.MAX_MODEL_LEN, kv_memory_bytes_per_device=_KV_MIB.value << 20,
                                      prefix_cache=True, speculation=spec), tokenizer=tokenizer)


def main(argv):
    del argv
    import jax
    from absl import logging

    logging.set_verbosity(logging.WARNING)

    from talaria_jax.engine import SamplingParams, enable_compilation_cache
    from talaria_jax.weights import load_model
    from talaria_jax.engine.spec.suffix import SpecConfig, SuffixDrafter
    from talaria_jax.sharding import make_mesh

    enable_compilation_cache()  # the three engines share their plain programs; a rerun compiles nothing
    data = agent_env.load_trajectories(_DATA.value)
    temperature = _TEMPERATURE.value
    reqs = requests(data)
    batches = [int(b) for b in _BATCHES.value]
    lm = load_model(agent_env.MODEL, mesh=make_mesh(jax.devices()[:1]), dtype="float32")
    cfg = {"always": SpecConfig(max_spec_tokens=_SPEC.value, tree=_TREE.value, policy="always"),
           "auto": SpecConfig(max_spec_tokens=_SPEC.value, tree=_TREE.value)}
    print(f"load average before: {os.getloadavg()[0]:.2f}; {len(reqs)} recorded requests; building 3 engines "
          f"(warm-up compiles every step shape)", flush=True)
    engines = {"plain": build(lm.model, lm.tokenizer, max(batches), None),
               **{k: build(lm.model, lm.tokenizer, max(batches), c) for k, c in cfg.items()}}
    rows = []
    for b in batches:
        for name, c in cfg.items():  # empty trees and no acceptance history at each batch size
            engines[name].drafter = SuffixDrafter(c)
            engines[name].spec_policy().reset()
        n = max(b, _REQUESTS.value)
        secs, tokens, outs = dict.fromkeys(engines, 0.0), 0, {k: [] for k in engines}
        before = {k: (e.stats.spec_steps, e.stats.draft_tokens, e.stats.accepted_tokens, e.stats.steps)
                  for k, e in engines.items()}
        for w in range(0, n, b):
            wave = [reqs[i % len(reqs)] for i in range(w, min(w + b, n))]
            prompts = [p for p, _, _ in wave]
            params = [SamplingParams(max_tokens=m, temperature=temperature, seed=s) for _, m, s in wave]
            for name, eng in engines.items():
                best = float("inf")
                for _ in range(_REPS.value):
                    t0 = time.perf_counter()
                    got = eng.generate(prompts, params, progress=False)
                    best = min(best, time.perf_counter() - t0)
                secs[name] += best
                outs[name] += [o.token_ids for o in got]
            tokens += sum(len(t) for t in outs["plain"][-len(wave):])
        same = outs["plain"] == outs["always"] == outs["auto"]
        row = {"batch": b, "requests": n, "tokens": tokens, "same_output": same}
        for name, eng in engines.items():
            row[f"{name}_tok_s"] = tokens / secs[name]
            steps, drafted, accepted, all_steps = (x - y for x, y in zip(
                (eng.stats.spec_steps, eng.stats.draft_tokens, eng.stats.accepted_tokens, eng.stats.steps), before[name]))
            row[f"{name}_accepted_per_step"] = accepted / steps if steps else None
            row[f"{name}_spec_share"] = steps / all_steps if all_steps else None
        row["always_ratio"] = row["always_tok_s"] / row["plain_tok_s"]
        row["auto_ratio"] = row["auto_tok_s"] / row["plain_tok_s"]
        row["policy_drafts"] = engines["auto"].spec_policy().draft_len(b)
        row["acceptance"] = engines["auto"].spec_policy().acceptance
        rows.append(row)
        print(f"batch {b}: plain {row['plain_tok_s']:.1f} tok/s, always x{row['always_ratio']:.2f}, "
              f"auto x{row['auto_ratio']:.2f} (policy drafts {row['policy_drafts']}), same output: {same}", flush=True)
    pol = engines["auto"].spec_policy()
    print("\nstep cost curve measured by the policy (ms; all-padding steps):")
    common.print_markdown_table([("tokens", "t", "d"), ("plain step", "plain", ".1f"), ("verifying step", "verify", ".1f")],
                                [{"t": t, "plain": 1e3 * pol.plain_s[t], "verify": 1e3 * pol.verify_s[t]}
                                 for t in pol.buckets])
    common.print_markdown_table(
        [("batch", "batch", "d"), ("requests", "requests", "d"), ("plain tok/s", "plain_tok_s", ".1f"),
         ("always tok/s", "always_tok_s", ".1f"), ("auto tok/s", "auto_tok_s", ".1f"),
         ("always / plain", "always_ratio", ".2f"), ("auto / plain", "auto_ratio", ".2f"),
         ("accepted / spec step", "always_accepted_per_step", ".2f"), ("auto: steps speculated", "auto_spec_share", ".0%"), ("policy drafts", "policy_drafts", "d"),
         ("same output", "same_output", "")], rows)
    print(f"\n{common.load_after()}")
    print("paper (WAR, low load): 1.4x rollout throughput from speculation")
    common.write_json(_OUT.value, {"rows": rows, "plain_s": pol.plain_s, "verify_s": pol.verify_s})


if __name__ == "__main__":
    app.run(main)
