"""Bounded loopback load through the router gateway: N concurrent agent sessions of a fixed number of
calls over two local instance servers (each hosting SmolLM2-135M-Instruct and two tiny models), under
talaria and under round, side by side in one run. Prints errors and TTFT, inter-token latency and SCT
percentiles per policy, and round/talaria ratios. A progress bar runs over the calls.

  python -m benchmarks.serve_load --sessions=12 --calls=4

A first, unmeasured pass under each policy compiles the step shapes the load meets.
"""
from __future__ import annotations

import math
import os

from absl import app, flags, logging

from benchmarks import common

demo = common.demo_flags()  # talaria_jax.launch.demo: its flags (--sessions, --calls, ...), with other defaults
_JSON = flags.DEFINE_string("json_out", None, "Write the summaries here.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from talaria_jax.scheduler.policies import POLICIES
    from talaria_jax.serve.load import summarize
    from talaria_jax.scheduler.policies import get_policy
    from talaria_jax.serve.local_cluster import demo_cluster

    load = os.getloadavg()[0]
    pols = demo._POLICIES.value
    if any(p not in POLICIES for p in pols):
        raise app.UsageError(f"--policies: unknown {[p for p in pols if p not in POLICIES]}; "
                             f"known: {', '.join(POLICIES)}")
    script = common.demo_script(demo)
    with demo_cluster(pols[0], "all") as cluster:  # every model on the devices, as measured in its docs page
        policies = [get_policy(p) for p in pols]
        warm = {"start_gap_s": demo._START_GAP.value, "progress": True}
        cluster.compare(policies, script, **warm)  # compiles the step shapes the load meets
        results = {p: r[0] for p, r in cluster.compare(policies, script, **warm).items()}
        stats = cluster.stats
    sums = {p: summarize(results[p]) for p in pols}
    ref = pols[0]
    print(f"\n{demo._SESSIONS.value} sessions x {demo._CALLS.value} calls, 2 instances; "
          f"{common.load_before_after(load)}")
    print(common.markdown_header(["metric", *pols, *(f"{p}/{ref}" for p in pols[1:])]))
    for key in ("errors", "calls", "ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "sct_p50_s", "sct_p90_s",
                "sct_mean_s"):
        vals = [sums[p][key] for p in pols]
        cells = [str(v) if isinstance(v, int) else f"{v:.3f}" for v in vals]
        ratios = [f"{v / vals[0]:.2f}x" if isinstance(v, float) and vals[0] and math.isfinite(v) else "-"
                  for v in vals[1:]]
        print(f"| {key} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    for key in ("switches", "switch_s", "restored_tokens", "recomputed_tokens"):
        print(f"| {key} | {' | '.join(f'{stats[p][key]:.4g}' for p in pols)} |" + " |" * (len(pols) - 1))
    common.write_json(_JSON.value, sums)


if __name__ == "__main__":
    app.run(main)
