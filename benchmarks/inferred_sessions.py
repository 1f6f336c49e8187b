"""Sessions named against sessions inferred, side by side in one run: the demo's agent sessions
(`make demo`'s cluster: two local instance servers hosting SmolLM2-135M-Instruct and two tiny
models, behind the gateway under talaria) sent once with `x-session-id` on every call and once with
no session named at all (the gateway infers each call's session from its prompt's token ids), the
two interleaved (each pass's first mode alternates), `--repeats` runs each after warm-up passes that
stop once one compiles (almost) nothing. Prints each run and, per mode, the medians over its runs and
its run of the best p50: SCT p50 and p90, the prompt tokens read from the prefix cache, the sessions
the gateway saw, the seconds spent compiling step shapes first met in the run (the instances run in
this process), and inferred/named ratios.

  python -m benchmarks.inferred_sessions --sessions=12 --calls=4 --repeats=3

"""
from __future__ import annotations

import os
import statistics

from absl import app, flags, logging

from benchmarks import common

demo = common.demo_flags()  # talaria_jax.launch.demo: its flags (--sessions, --calls, ...), with other defaults
_REPEATS = flags.DEFINE_integer("repeats", 3, "Measured runs of each mode (interleaved).")
_WARMUPS = flags.DEFINE_integer("warmups", 3, "Unmeasured passes of both modes at most, until one compiles under "
                                "a second.")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from talaria_jax.engine.compile_cache import compile_seconds
    from talaria_jax.scheduler.policies import get_policy
    from talaria_jax.serve.load import run_sessions, summarize
    from talaria_jax.serve.local_cluster import KEY, demo_cluster

    load = os.getloadavg()[0]
    policy = get_policy("talaria")
    script = common.demo_script(demo)
    runs: dict[str, list[dict]] = {"named": [], "inferred": []}

    def run(mode: str) -> dict:
        compiled = compile_seconds()
        with cluster.gateway(policy) as url:
            res = run_sessions(url, KEY, script, start_gap_s=demo._START_GAP.value, progress=True,
                               named=mode == "named")
            sessions = len(cluster.router.state.sessions)
        return summarize(res) | {"cached_tokens": sum(c.cached_tokens for r in res for c in r.calls),
                                 "gateway_sessions": sessions, "compile_s": compile_seconds() - compiled}
    with demo_cluster("talaria", "all") as cluster:  # every model on the devices, as measured in its docs page
        for k in range(_WARMUPS.value):  # step shapes first met in a run compile inside it, delaying every session
            compiled = sum(run(mode)["compile_s"] for mode in ("inferred", "named"))
            print(f"warm-up pass {k + 1}: {compiled:.1f} s compiling", flush=True)
            if compiled < 1.0:
                break
        for rep in range(_REPEATS.value):
            for mode in ("named", "inferred") if rep % 2 else ("inferred", "named"):  # each first in turn
                s = run(mode)
                runs[mode].append(s)
                print(f"run {rep + 1} {mode}: SCT p50 {s['sct_p50_s']:.3f} s, p90 {s['sct_p90_s']:.3f} s, "
                      f"{s['cached_tokens']} cached prompt tokens, {s['gateway_sessions']} sessions, "
                      f"{s['errors']} errors, {s['compile_s']:.1f} s compiling, load average "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
    print(f"\n{demo._SESSIONS.value} sessions x {demo._CALLS.value} calls, 2 instances, talaria, "
          f"{_REPEATS.value} runs each; {common.load_before_after(load)}")
    print(common.markdown_header(["metric", "named", "inferred", "inferred / named"]))
    keys = ("errors", "sct_p50_s", "sct_p90_s", "cached_tokens", "gateway_sessions", "compile_s")
    for stat, pick in (("median", statistics.median), ("best p50", None)):
        for key in keys:
            if pick is None and key not in ("sct_p50_s", "sct_p90_s", "compile_s"):
                continue
            a, b = ((pick([r[key] for r in runs[m]]) if pick else min(runs[m], key=lambda r: r["sct_p50_s"])[key])
                    for m in ("named", "inferred"))
            cell = (lambda v: f"{v:.3f}") if isinstance(a, float) else str
            ratio = f"{b / a:.3f}" if a else "-"
            print(f"| {key} ({stat}) | {cell(a)} | {cell(b)} | {ratio} |")
    common.write_json(_JSON.value, runs)


if __name__ == "__main__":
    app.run(main)
