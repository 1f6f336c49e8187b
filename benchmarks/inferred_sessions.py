"""Sessions named against sessions inferred, side by side in one run: the demo's agent sessions
(`make demo`'s cluster: two local instance servers hosting SmolLM2-135M-Instruct and two tiny
models, behind the gateway under talaria) sent once with `x-session-id` on every call and once with
no session named at all (the gateway infers each call's session from its prompt's token ids), the
two interleaved (each pass's first mode alternates), best of `--repeats` each. Prints SCT p50 and p90, the prompt tokens read from the
prefix cache, the sessions the gateway saw, and inferred/named ratios.

  python benchmarks/inferred_sessions.py --sessions=12 --calls=4 --repeats=2

A first, unmeasured pass compiles the step shapes the load meets.
"""
from __future__ import annotations

import json
import os

from absl import app, flags, logging

from talaria_jax.launch import demo  # its flags (--sessions, --calls, ...), with other defaults here

for name, default in (("sessions", 12), ("calls", 4), ("max_tokens", 32), ("start_gap_s", 0.25)):
    flags.FLAGS.set_default(name, default)
_REPEATS = flags.DEFINE_integer("repeats", 2, "Runs of each mode (interleaved); the best SCT p50 is kept.")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from talaria_jax.scheduler.policies import get_policy
    from talaria_jax.serve.load import run_sessions, summarize
    from talaria_jax.serve.local_cluster import KEY, demo_cluster, demo_sessions

    load = os.getloadavg()[0]
    policy = get_policy("talaria")
    script = demo_sessions(demo._SESSIONS.value, demo._CALLS.value, max_tokens=demo._MAX_TOKENS.value,
                           tool_gap_s=demo._TOOL_GAP.value, seed=demo._SEED.value)
    best: dict[str, dict] = {}
    with demo_cluster("talaria") as cluster:
        for rep in range(_REPEATS.value + 1):
            for mode in ("named", "inferred") if rep % 2 else ("inferred", "named"):  # each first in turn
                with cluster.gateway(policy) as url:
                    res = run_sessions(url, KEY, script, start_gap_s=demo._START_GAP.value, progress=True,
                                       named=mode == "named")
                    sessions = len(cluster.router.state.sessions)
                if rep == 0:
                    continue  # the warm-up pass
                s = summarize(res) | {"cached_tokens": sum(c.cached_tokens for r in res for c in r.calls),
                                      "gateway_sessions": sessions}
                print(f"run {rep} {mode}: SCT p50 {s['sct_p50_s']:.3f} s, p90 {s['sct_p90_s']:.3f} s, "
                      f"{s['cached_tokens']} cached prompt tokens, {sessions} sessions, {s['errors']} errors",
                      flush=True)
                if mode not in best or s["sct_p50_s"] < best[mode]["sct_p50_s"]:
                    best[mode] = s
    print(f"\n{demo._SESSIONS.value} sessions x {demo._CALLS.value} calls, 2 instances, talaria, best of "
          f"{_REPEATS.value}; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("| metric | named | inferred | inferred / named |")
    print("|---|---|---|---|")
    for key in ("errors", "sct_p50_s", "sct_p90_s", "cached_tokens", "gateway_sessions"):
        a, b = best["named"][key], best["inferred"][key]
        cell = (lambda v: f"{v:.3f}") if isinstance(a, float) else str
        print(f"| {key} | {cell(a)} | {cell(b)} | {b / a:.3f} |" if a else f"| {key} | {cell(a)} | {cell(b)} | - |")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(best, f, indent=1)


if __name__ == "__main__":
    app.run(main)
