"""The top-k / top-p filter of the sampler: ours (`sampling.filter_logits`, a bit-by-bit threshold
search, no sort) against the same filter by a full sort of the vocabulary (the reference below), in
turns, best of `--reps`, on fp32 logits of each vocabulary size and row count (rows: the sequences
of a step that sample). The greedy sampler's cost (`sample` with temperature 0: log-softmax, top
logprobs, argmax) is printed beside them for scale, and the rows whose kept sets differ (the two
sum the mass in different orders in fp32, so a row whose boundary lies within rounding can keep one
token more or fewer).

  .venv/bin/python -m benchmarks.sampler --out=/tmp/sampler.json
"""
from __future__ import annotations

import time

from absl import app, flags

from benchmarks import common

_VOCABS = flags.DEFINE_list("vocabs", ["32000", "49152", "128256", "151936", "201088"], "Vocabulary sizes.")
_ROWS = flags.DEFINE_list("rows", ["1", "8", "32"], "Sampling rows (sequences of a step).")
_REPS = flags.DEFINE_integer("reps", 5, "Reps per side and point, in turns (best is reported).", lower_bound=1)
_TOP_P = flags.DEFINE_float("top_p", 0.95, "top_p of every row.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "top_k of every row (0: off).", lower_bound=0)
_THREADS = flags.DEFINE_integer("threads", None, "Cores (default: all).")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def sorted_filter(scaled, top_k, top_p):
    """The reference: the top-k / top-p set by a full sort of each row (`filter_logits`'s semantics)."""
    import jax
    import jax.numpy as jnp

    v = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_sorted = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (jnp.arange(v)[None, :] < k[:, None])
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= jnp.maximum(cutoff, kth), scaled, -jnp.inf)


def main(argv):
    del argv
    threads = common.set_threads(_THREADS.value, torch_side=False)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from talaria_jax.engine.sampling import filter_logits, sample

    machine = common.Machine.start(threads)
    print(f"top_p {_TOP_P.value}, top_k {_TOP_K.value} in every row; best of {_REPS.value} reps a side, in turns")
    print(machine.report(), flush=True)
    rng = np.random.RandomState(0)
    greedy = jax.jit(sample)
    rows_out = []
    for v in (int(x) for x in _VOCABS.value):
        for r in (int(x) for x in _ROWS.value):
            logits = jnp.asarray(rng.randn(r, v).astype(np.float32) * 3)
            top_k, top_p = jnp.full(r, _TOP_K.value, jnp.int32), jnp.full(r, _TOP_P.value, jnp.float32)
            compiled, compile_s = {}, {}
            for name, f in (("search", filter_logits), ("sort", sorted_filter)):
                t = time.perf_counter()
                compiled[name] = jax.jit(f).lower(logits, top_k, top_p).compile()
                compile_s[name] = time.perf_counter() - t
            kept = {n: np.isfinite(np.asarray(c(logits, top_k, top_p))).sum(-1) for n, c in compiled.items()}
            zeros = (jnp.zeros(r, jnp.float32), jnp.zeros(r, jnp.int32), jnp.ones(r, jnp.float32),
                     jnp.zeros((r, 2), jnp.uint32), jnp.zeros(r, jnp.int32))
            sides = {n: (lambda c=c: common.timed(lambda: c(logits, top_k, top_p))) for n, c in compiled.items()}
            sides["greedy sample"] = lambda: common.timed(lambda: greedy(logits, *zeros))
            best = common.interleave(sides, _REPS.value)
            row = dict(vocab=v, rows=r, search_ms=best["search"] * 1e3, sort_ms=best["sort"] * 1e3,
                       sort_over_search=best["sort"] / best["search"], greedy_sample_ms=best["greedy sample"] * 1e3,
                       search_compile_s=compile_s["search"], sort_compile_s=compile_s["sort"],
                       rows_kept_apart=int((kept["search"] != kept["sort"]).sum()))
            rows_out.append(row)
            print(f"  vocab {v:6d} rows {r:3d}: search {row['search_ms']:8.2f} ms  sort {row['sort_ms']:8.2f} ms  "
                  f"sort/search {row['sort_over_search']:6.1f}  greedy sample {row['greedy_sample_ms']:7.2f} ms  "
                  f"rows whose sets differ {row['rows_kept_apart']}", flush=True)
    machine.stop()
    common.print_markdown_table(
        [("vocab", "vocab", "d"), ("rows", "rows", "d"), ("search ms", "search_ms", ".2f"),
         ("sort ms", "sort_ms", ".2f"), ("sort / search", "sort_over_search", ".1f"),
         ("greedy sample() ms", "greedy_sample_ms", ".2f"),
         ("compile s, search", "search_compile_s", ".2f"), ("compile s, sort", "sort_compile_s", ".2f"),
         ("rows kept apart", "rows_kept_apart", "d")], rows_out)
    print(machine.report())
    common.write_json(_OUT.value, dict(top_p=_TOP_P.value, top_k=_TOP_K.value, reps=_REPS.value, rows=rows_out),
                      machine)


if __name__ == "__main__":
    app.run(main)
