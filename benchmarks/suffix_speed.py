"""Suffix drafter speed: the Python trie, the compiled backend, and arctic-inference's `SuffixDecodingCache`.

A decode step of the drafter: every sequence in flight gets its next token (`extend`) and a draft (one
`draft()` call for the batch). Each batch size starts B sequences of ~--context agent-like tokens: the
recorded trajectories' texts (benchmarks/data/agent_trajectories.json: prompt, responses and tool
outputs of each episode), each sequence an agent session of several episodes (see `streams`), started
with its first prompt and extended with the rest, all in flight in one tenant's global tree (so the
sessions draft from each other's text). Then --steps steps per rep; the sides take turns rep by rep (`common.interleave`),
best of --reps, as ms per step (extend of all + draft of all). Rows:

- python: `SuffixDrafter(cfg, backend="python")`, the reference.
- native: `SuffixDrafter(cfg)` on the compiled backend, called as the engine calls it (`extend(rid, (tok,))`
  per sequence, then `draft(rids)`).
- native batched: the same drafter with the step's tokens in one `extend_batch(rids, tokens)` call.
- arctic: arctic-inference's `SuffixDecodingCache` (`add_active_response` per sequence, `speculate` per
  sequence with its last --max_depth tokens), where it is importable (benchmarks/build_arctic_suffix.sh
  builds it); skipped with one line where not. Its drafts are its own (ties between equally frequent
  continuations broken its way; the request's prompt in a tree of its own, where ours scans the
  request's whole text): "drafts = python" gives the share of them with the same tokens and tree as ours.

The native sides' drafts are checked against Python's at every timed and warm-up step (tokens, parents,
probabilities, score, match length): "drafts = python" says whether all were identical.

  .venv/bin/python -m benchmarks.suffix_speed
  .venv/bin/python -m benchmarks.suffix_speed --batches=64 --tree --json=/tmp/suffix_speed.json
"""
from __future__ import annotations

import importlib
import time

import numpy as np
from absl import app, flags

from benchmarks import common
from talaria_jax.rollout import agent_env

_BATCHES = flags.DEFINE_list("batches", ["8", "64", "256"], "Sequences in flight (one row group each).")
_CONTEXT = flags.DEFINE_integer("context", 2000, "Tokens of each sequence before the timed steps.")
_STEPS = flags.DEFINE_integer("steps", 20, "Steps (extend all + draft all) per rep.")
_REPS = flags.DEFINE_integer("reps", 5, "Reps per side, interleaved; the best counts.")
_SPEC = flags.DEFINE_integer("max_spec_tokens", 16, "Draft tokens per sequence and step at most.")
_FACTOR = flags.DEFINE_float("max_spec_factor", 1.0, "A match of m tokens drafts at most factor x m + offset.")
_OFFSET = flags.DEFINE_float("max_spec_offset", 0.0, "See --max_spec_factor.")
_MIN_PROB = flags.DEFINE_float("min_token_prob", 0.1, "A draft token's path probability must reach this.")
_DEPTH = flags.DEFINE_integer("max_depth", 64, "Suffix tree depth (the longest match).")
_TREE = flags.DEFINE_bool("tree", False, "Tree drafts instead of chains.")
_DATA = flags.DEFINE_string("data", str(common.TRAJECTORIES), "Recorded trajectories.")
_JSON = flags.DEFINE_string("json", None, "Write the results as JSON here.")


def streams(n: int, length: int) -> tuple[list[np.ndarray], list[int]]:
    """n token streams of `length` tokens and their prompt lengths: an agent's session each, episode after
    episode. Stream i is trajectory j = i % T's last context (its prompt, responses and tool outputs),
    then the contexts of the trajectories j + 4k + r (r = i // T; the recording holds 4 siblings of each
    task in a row: mostly other tasks' episodes, each opening with the same system prompt)."""
    trajs = agent_env.load_trajectories(_DATA.value)
    texts = [t.turns[-1].prompt + t.turns[-1].response for t in trajs]
    out, prompts = [], []
    for i in range(n):
        j, r = i % len(trajs), i // len(trajs)
        toks, k = list(texts[j]), 0
        while len(toks) < length:
            k += 1
            toks += texts[(j + 4 * k + r) % len(trajs)]
        out.append(np.asarray(toks[:length], np.int32))
        prompts.append(len(trajs[j].turns[0].prompt))
    return out, prompts


def key(d) -> tuple:
    return (d.tokens.tolist(), d.parents.tolist(), d.probs.tobytes(), d.score, d.match_len)


class Ours:
    """A SuffixDrafter side; `batched`: the step's tokens in one extend_batch call."""

    def __init__(self, cfg, backend: str, batched: bool, seqs, prompts, rids):
        from talaria_jax.engine.spec.suffix import SuffixDrafter

        self.d, self.batched, self.rids = SuffixDrafter(cfg, backend=backend), batched, rids
        for rid, s, p in zip(rids, seqs, prompts):
            self.d.start(rid, s[:p].tolist())
            self.d.extend(rid, s[p:_CONTEXT.value].tolist())
        self.drafts: list[list] = []  # per step: the batch's drafts

    def step(self, toks: list[int], contexts) -> float:
        d, rids = self.d, self.rids
        t0 = time.perf_counter()
        if self.batched:
            d.extend_batch(rids, toks)
        else:
            for rid, t in zip(rids, toks):
                d.extend(rid, (t,))
        out = d.draft(rids)
        dt = time.perf_counter() - t0
        self.drafts.append(out)
        return dt


class Arctic:
    def __init__(self, cfg, seqs, prompts, rids):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cfg, self.rids = cfg, rids
        self.c = SuffixDecodingCache(max_tree_depth=cfg.max_depth, max_cached_requests=-1)
        for rid, s, p in zip(rids, seqs, prompts):
            self.c.start_request(rid, s[:p])
            self.c.add_active_response(rid, s[p:_CONTEXT.value])
        self.drafts: list[list] = []

    def step(self, toks: list[int], contexts) -> float:
        c, cfg = self.c, self.cfg
        t0 = time.perf_counter()
        for rid, t in zip(self.rids, toks):
            c.add_active_response(rid, [t])
        out = [c.speculate(rid, ctx, cfg.max_spec_tokens, cfg.max_spec_factor, cfg.max_spec_offset,
                           cfg.min_token_prob, cfg.tree) for rid, ctx in zip(self.rids, contexts)]
        dt = time.perf_counter() - t0
        self.drafts.append(out)
        return dt


def main(argv):
    del argv
    from talaria_jax.engine.spec import suffix
    from talaria_jax.engine.spec.suffix import SpecConfig

    cfg = SpecConfig(max_spec_tokens=_SPEC.value, max_spec_factor=_FACTOR.value, max_spec_offset=_OFFSET.value,
                     min_token_prob=_MIN_PROB.value, tree=_TREE.value, max_depth=_DEPTH.value, policy="always")
    have_native = suffix.native is not None
    if not have_native:
        print(f"SKIP native: the compiled backend is not built ({suffix.NATIVE_ERROR})")
    try:
        importlib.import_module("arctic_inference.suffix_decoding")
        have_arctic = True
    except ImportError as e:
        have_arctic = False
        print(f"SKIP arctic: arctic-inference's suffix decoding is not importable ({e})")
    steps, reps = _STEPS.value, _REPS.value
    batches = [int(b) for b in _BATCHES.value]
    length = _CONTEXT.value + (reps + 1) * steps + 1
    print(f"{_CONTEXT.value} tokens per sequence, then {steps} steps per rep (extend every sequence by one token, "
          f"draft for each), best of {reps}; {'tree' if cfg.tree else 'chain'} drafts, max_spec_tokens "
          f"{cfg.max_spec_tokens}, max_spec_factor {cfg.max_spec_factor}, min_token_prob {cfg.min_token_prob}, "
          f"max_depth {cfg.max_depth}")
    machine = common.Machine.start(1)
    rows = []
    for n in batches:
        seqs, prompts = streams(n, length)
        rids = [f"s{i}" for i in range(n)]
        t0 = time.perf_counter()
        sides = {"python": Ours(cfg, "python", False, seqs, prompts, rids)}
        if have_native:
            sides["native"] = Ours(cfg, "native", False, seqs, prompts, rids)
            sides["native batched"] = Ours(cfg, "native", True, seqs, prompts, rids)
        if have_arctic:
            sides["arctic"] = Arctic(cfg, seqs, prompts, rids)
        print(f"  {n} sequences: set up in {time.perf_counter() - t0:.1f} s", flush=True)
        pos = {name: _CONTEXT.value for name in sides}

        def rep(name):
            side, total = sides[name], 0.0
            for _ in range(steps):
                p = pos[name]
                toks = [int(s[p]) for s in seqs]
                contexts = [s[max(0, p + 1 - cfg.max_depth):p + 1] for s in seqs]
                total += side.step(toks, contexts)
                pos[name] = p + 1
            return total

        best = common.interleave({name: (lambda name=name: rep(name)) for name in sides}, reps)
        ref = sides["python"].drafts
        for name, side in sides.items():
            same = None
            if name == "arctic":  # its own drafter: the share of its drafts with the same tokens and tree
                pairs = [(a, b) for xs, ys in zip(ref, side.drafts) for a, b in zip(xs, ys)]
                agree = np.mean([a.tokens.tolist() == b.token_ids and a.parents.tolist() == b.parents
                                 for a, b in pairs])
                drafted = np.mean([len(b.token_ids) for _, b in pairs])
            else:
                if name != "python":
                    same = len(side.drafts) == len(ref) and all(
                        key(a) == key(b) for xs, ys in zip(ref, side.drafts) for a, b in zip(xs, ys))
                drafted = np.mean([len(d) for step in side.drafts for d in step])
            ms = 1e3 * best[name] / steps
            rows.append(dict(side=name, batch=n, ms_per_step=ms, us_per_seq=1e3 * ms / n,
                             vs_python=best["python"] / best[name], draft_len=drafted,
                             drafts_equal=(f"tokens of {agree:.0%}" if name == "arctic" else
                                           None if same is None else "yes" if same else "NO"),
                             steps_checked=len(ref) if same is not None else None))
            print(f"    {name:15s} {ms:8.3f} ms/step", flush=True)
            if same is False:
                print(f"WARNING: {name}'s drafts differ from python's at {n} sequences")
    machine.stop()
    common.print_markdown_table(
        [("drafter", "side", "s"), ("sequences", "batch", "d"), ("ms / step", "ms_per_step", ".3f"),
         ("us / sequence", "us_per_seq", ".2f"), ("x python", "vs_python", ".1f"), ("draft len", "draft_len", ".2f"),
         ("drafts = python", "drafts_equal", "s"), ("steps checked", "steps_checked", "d")], rows)
    print(machine.report())
    names = ("batches", "context", "steps", "reps", "max_spec_tokens", "max_spec_factor", "max_spec_offset",
             "min_token_prob", "max_depth", "tree")
    common.write_json(_JSON.value, dict(flags={k: flags.FLAGS[k].value for k in names}, rows=rows), machine)


if __name__ == "__main__":
    app.run(main)
