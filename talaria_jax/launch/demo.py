"""make demo: agent sessions through the router gateway over two local instance servers, with the real
`openai` client, under talaria and under round; their session completion times side by side and each
session's first reply.

Each instance hosts the embedded SmolLM2-135M-Instruct (chat sessions, real text) and the tiny test
configs (random weights, completion sessions), on one device each, so the instances switch models and
the policies differ in how. Runs on one CPU machine with no downloads.
"""
from __future__ import annotations

import math

from absl import app, flags, logging

_SESSIONS = flags.DEFINE_integer("sessions", 6, "Agent sessions.", lower_bound=1)
_CALLS = flags.DEFINE_integer("calls", 3, "Calls per session.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 24, "Tokens per reply.", lower_bound=1)
_TOOL_GAP = flags.DEFINE_float("tool_gap_s", 0.3, "Median tool time between a session's calls (s).", lower_bound=0)
_START_GAP = flags.DEFINE_float("start_gap_s", 0.5, "Seconds between session starts.", lower_bound=0)
_POLICIES = flags.DEFINE_list("policies", ["talaria", "round"], "Policies to compare.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the scripted sessions.")

def _fmt(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.1f}"


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from talaria_jax.scheduler.policies import POLICIES
    from talaria_jax.serve.load import summarize
    from talaria_jax.serve.local_cluster import RANDOM, compare_policies

    pols = _POLICIES.value
    if any(p not in POLICIES for p in pols):
        raise app.UsageError(f"--policies: unknown {[p for p in pols if p not in POLICIES]}; "
                             f"known: {', '.join(POLICIES)}")
    script, results, stats = compare_policies(pols, sessions=_SESSIONS.value, calls=_CALLS.value,
                                              max_tokens=_MAX_TOKENS.value, tool_gap_s=_TOOL_GAP.value,
                                              start_gap_s=_START_GAP.value, seed=_SEED.value)
    by = {p: {r.id: r for r in results[p]} for p in pols}
    print("\nsession completion time (s), each session through the gateway:")
    print(f"| session | model | calls | {' | '.join(pols)} |")
    print("|---|---|---|" + "---|" * len(pols))
    for s in script:
        cells = [_fmt(by[p][s.id].sct_s) + (" (error)" if by[p][s.id].errors else "") for p in pols]
        print(f"| {s.id} | {s.model} | {len(s.observations)} | {' | '.join(cells)} |")
    sums = {p: summarize(results[p]) for p in pols}
    for q in ("p50", "p90"):
        print(f"| {q} | | | {' | '.join(_fmt(sums[p][f'sct_{q}_s']) for p in pols)} |")
    if len(pols) >= 2:
        a, b = pols[0], pols[1]
        print(f"\n{b}/{a} SCT: p50 {sums[b]['sct_p50_s'] / sums[a]['sct_p50_s']:.2f}x, "
              f"p90 {sums[b]['sct_p90_s'] / sums[a]['sct_p90_s']:.2f}x; errors: "
              + ", ".join(f"{p} {sums[p]['errors']}" for p in pols))
    for k in ("switches", "switch_s", "restored_tokens", "recomputed_tokens"):
        print(f"{k}: " + ", ".join(f"{p} {stats[p][k]:.4g}" for p in pols))
    print(f"\nfirst replies ({pols[0]}):")
    for s in script:
        calls = by[pols[0]][s.id].calls
        if s.model in RANDOM:
            reply = f"({calls[0].completion_tokens} tokens of random weights)" if calls else "-"
        else:
            reply = repr(calls[0].text.strip()[:110]) if calls else "-"
        print(f"  {s.id} [{s.model}] {reply}")


def run():
    app.run(main)


if __name__ == "__main__":
    run()
