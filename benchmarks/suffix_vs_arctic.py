"""Suffix drafts: ours (engine/spec/suffix.py) vs arctic-inference's `SuffixDecodingCache`, same token streams.

Replays `benchmarks/data/agent_trajectories.json` through both drafters with the same parameters, in
the order an RL/agent loop runs them: turn by turn, all trajectories of all tasks in flight together
(so siblings draft from each other's in-flight responses; finished turns stay in the global tree).
At each step every in-flight sequence drafts from its context (prompt + response so far); the
accepted length is the longest path of the draft (chain or tree) that matches the recorded next
tokens, and the sequence advances by accepted + 1 tokens (a speculative step), which are fed to the
drafter (`extend` / `add_active_response`). A finished response is `finish`ed / `stop_request`ed.
Both sides see the same recorded tokens; their steps differ only through their drafts.

Timed: the drafting of each step's batch (ours: one `draft()` call; arctic: one `speculate()` per
sequence), best of --reps replays. "full batch" is the batches with every sequence in flight (the
first steps of each turn). `--replicas=8` replays each trajectory 8 times under new ids (32 -> 256
sequences in flight: 8 tasks x 32 siblings) to time a batch of 256; the copies run in lockstep, so
they add no new text to draft from, and the accepted lengths stay about those of the recording.

  .venv/bin/python -m benchmarks.suffix_vs_arctic
  .venv/bin/python -m benchmarks.suffix_vs_arctic --replicas=8 --tree=chain --json=/tmp/suffix.json

The reference is built from source (C++/nanobind; the package's own build pulls torch for its other
extensions, which this one does not need):

  bash benchmarks/build_arctic_suffix.sh
"""
from __future__ import annotations

import importlib
import sys
import time

import numpy as np
from absl import app, flags

from benchmarks import common
from talaria_jax.rollout import agent_env

_SPEC = flags.DEFINE_integer("max_spec_tokens", 16, "Draft tokens per sequence and step at most.")
_FACTOR = flags.DEFINE_float("max_spec_factor", 1.0, "A match of m tokens drafts at most factor x m + offset.")
_OFFSET = flags.DEFINE_float("max_spec_offset", 0.0, "See --max_spec_factor.")
_MIN_PROB = flags.DEFINE_float("min_token_prob", 0.1, "A draft token's path probability must reach this.")
_DEPTH = flags.DEFINE_integer("max_depth", 64, "Suffix tree depth (the longest match).")
_TREE = flags.DEFINE_enum("tree", "both", ["both", "chain", "tree"], "Draft shapes to run.")
_LIMIT = flags.DEFINE_integer("limit", None, "Use only the first N trajectories.")
_REPLICAS = flags.DEFINE_integer("replicas", 1, "Copies of each trajectory in flight (8: a 256-sequence batch).")
_REPS = flags.DEFINE_integer("reps", 3, "Replays per drafter; drafting time: the best.")
_DATA = flags.DEFINE_string("data", str(common.TRAJECTORIES), "Recorded trajectories.")
_JSON = flags.DEFINE_string("json", None, "Write the results as JSON here.")


class Ours:
    def __init__(self, tree: bool):
        from talaria_jax.engine.spec.suffix import SpecConfig, SuffixDrafter

        self.d = SuffixDrafter(SpecConfig(max_spec_tokens=_SPEC.value, max_spec_factor=_FACTOR.value,
                                          max_spec_offset=_OFFSET.value, min_token_prob=_MIN_PROB.value,
                                          tree=tree, max_depth=_DEPTH.value))
        self.start, self.extend, self.finish = self.d.start, self.d.extend, self.d.finish

    def draft(self, rids, contexts):  # ours keeps each request's last tokens itself
        return [(d.tokens.tolist(), d.parents.tolist()) for d in self.d.draft(rids)]


class Arctic:
    def __init__(self, tree: bool):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.tree = tree
        self.c = SuffixDecodingCache(max_tree_depth=_DEPTH.value, max_cached_requests=-1)
        self.start, self.extend, self.finish = self.c.start_request, self.c.add_active_response, self.c.stop_request

    def draft(self, rids, contexts):
        out = []
        for rid, ctx in zip(rids, contexts):
            d = self.c.speculate(rid, ctx, _SPEC.value, _FACTOR.value, _OFFSET.value, _MIN_PROB.value, self.tree)
            out.append((d.token_ids, d.parents))
        return out


def accepted(tokens, parents, truth) -> int:
    """The longest root path of the draft (parents before children, -1: the root) matching truth."""
    depth = [0] * len(tokens)  # matched depth of node i, 0: not on a matching path
    best = 0
    for i, (t, p) in enumerate(zip(tokens, parents)):
        d = 1 if p < 0 else depth[p] + 1 if depth[p] else 0
        if d and d <= len(truth) and t == truth[d - 1]:
            depth[i] = d
            best = max(best, d)
    return best


def replay(drafter, trajectories, replicas: int) -> dict:
    """Runs the protocol of the docstring; returns totals (seconds for the times)."""
    steps = acc = drafted = tokens = batches = seq_drafts = full_batches = 0
    batch_s = full_s = 0.0
    n_all = replicas * len(trajectories)
    for turn in range(max(len(t.turns) for t in trajectories)):
        live = {}  # rid -> [prompt + response, prompt length, response tokens so far]
        for i, traj in enumerate(trajectories):
            if turn < len(traj.turns):
                u = traj.turns[turn]
                for r in range(replicas):
                    rid = f"{i}/{r}/{turn}"
                    drafter.start(rid, u.prompt)
                    live[rid] = [np.asarray(u.prompt + u.response, np.int32), len(u.prompt), 0]
        while live:
            rids = list(live)
            ctxs = [text[max(0, plen + pos - _DEPTH.value):plen + pos] for text, plen, pos in live.values()]
            t0 = time.perf_counter()
            drafts = drafter.draft(rids, ctxs)
            dt = time.perf_counter() - t0
            batch_s, batches, seq_drafts = batch_s + dt, batches + 1, seq_drafts + len(rids)
            if len(rids) == n_all:
                full_s, full_batches = full_s + dt, full_batches + 1
            for rid, (toks, parents) in zip(rids, drafts):
                text, plen, pos = live[rid]
                truth = text[plen + pos:].tolist()
                a = accepted(toks, parents, truth)
                n = min(a + 1, len(truth))
                steps, acc, drafted, tokens = steps + 1, acc + a, drafted + len(toks), tokens + n
                drafter.extend(rid, truth[:n])
                live[rid][2] = pos + n
                if n == len(truth):
                    drafter.finish(rid)
                    del live[rid]
    return dict(steps=steps, accepted=acc / steps, draft_len=drafted / steps, tokens_per_step=tokens / steps,
                batches=batches, mean_batch=seq_drafts / batches, batch_s=batch_s, seq_drafts=seq_drafts,
                full_batch=n_all, full_batches=full_batches, full_s=full_s)


def main(argv):
    del argv
    try:
        importlib.import_module("arctic_inference.suffix_decoding")
    except ImportError as e:
        print(f"SKIP: arctic-inference's suffix decoding is not importable ({e}); install it as this script's "
              "docstring says.")
        sys.exit(0)
    trajs = agent_env.load_trajectories(_DATA.value)[:_LIMIT.value]
    shapes = ["chain", "tree"] if _TREE.value == "both" else [_TREE.value]
    print(f"{len(trajs)} trajectories x {_REPLICAS.value}, {sum(len(u.response) for t in trajs for u in t.turns)} "
          f"response tokens each; max_spec_tokens {_SPEC.value}, max_spec_factor {_FACTOR.value}, max_spec_offset "
          f"{_OFFSET.value}, min_token_prob {_MIN_PROB.value}, max_depth {_DEPTH.value}; best of {_REPS.value}")
    rows = []
    for shape in shapes:
        for name, cls in (("ours", Ours), ("arctic", Arctic)):
            runs = [replay(cls(shape == "tree"), trajs, _REPLICAS.value) for _ in range(_REPS.value)]
            r = runs[0]  # the replay is deterministic: only the times differ
            batch_s, full_s = min(x["batch_s"] for x in runs), min(x["full_s"] for x in runs)
            rows.append(dict(method=name, shape=shape, accepted=r["accepted"], draft_len=r["draft_len"],
                             steps=r["steps"], tokens_per_step=r["tokens_per_step"], mean_batch=r["mean_batch"],
                             batch_ms=1e3 * batch_s / r["batches"], seq_ms=1e3 * batch_s / r["seq_drafts"],
                             full_batch=r["full_batch"], full_batch_ms=1e3 * full_s / max(r["full_batches"], 1),
                             accepted_ratio=None, time_ratio=None))
            print(f"  {name:6s} {shape:5s}: accepted {r['accepted']:.3f}/step, {r['steps']} steps, "
                  f"{rows[-1]['batch_ms']:.2f} ms/batch of {r['mean_batch']:.1f}", flush=True)
        ours, ref = rows[-2], rows[-1]
        ours["accepted_ratio"] = ours["accepted"] / ref["accepted"]
        ours["time_ratio"] = ours["batch_ms"] / ref["batch_ms"]
    common.print_markdown_table(
        [("method", "method", "s"), ("draft", "shape", "s"), ("accepted/step", "accepted", ".3f"),
         ("draft len", "draft_len", ".2f"), ("steps", "steps", "d"), ("tokens/step", "tokens_per_step", ".3f"),
         ("mean batch", "mean_batch", ".1f"), ("ms/batch", "batch_ms", ".2f"), ("ms/seq", "seq_ms", ".4f"),
         ("full batch", "full_batch", "d"), ("ms/full batch", "full_batch_ms", ".2f"),
         ("accepted ours/arctic", "accepted_ratio", ".3f"), ("time ours/arctic", "time_ratio", ".2f")], rows)
    names = ("max_spec_tokens", "max_spec_factor", "max_spec_offset", "min_token_prob", "max_depth", "limit",
             "replicas", "reps")
    common.write_json(_JSON.value, dict(flags={k: flags.FLAGS[k].value for k in names}, trajectories=len(trajs),
                                        rows=rows))


if __name__ == "__main__":
    app.run(main)
