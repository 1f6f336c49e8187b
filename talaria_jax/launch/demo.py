"""make demo: agent sessions through the router gateway over two local instance servers, with the real
`openai` client, under talaria and under round, then the same two policies in the simulator on 8 x H200
over the paper's workload.

Each instance hosts the embedded SmolLM2-135M-Instruct (chat sessions, real text) and the tiny test
configs (random weights, completion sessions), on one device each, so the instances switch models and
the policies differ in how. Runs on one CPU machine with no downloads. It says what it waits for at
every step: loading (the GGUF is converted once into ~/.cache/talaria_jax), compiling (step shapes are
compiled as they first occur and kept in the compilation cache), and each policy's pass.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
from absl import app, flags, logging

_SESSIONS = flags.DEFINE_integer("sessions", 4, "Agent sessions.", lower_bound=1)
_CALLS = flags.DEFINE_integer("calls", 3, "Calls per session.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Tokens per reply.", lower_bound=1)
_TOOL_GAP = flags.DEFINE_float("tool_gap_s", 0.3, "Median tool time between a session's calls (s).", lower_bound=0)
_START_GAP = flags.DEFINE_float("start_gap_s", 0.5, "Seconds between session starts.", lower_bound=0)
_POLICIES = flags.DEFINE_list("policies", ["talaria", "round"], "Policies to compare.")
_RUNS = flags.DEFINE_integer("runs", 2, "Measured passes per policy, interleaved: their spread is the noise.",
                             lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the scripted sessions.")
_WEIGHTS = flags.DEFINE_string("weight_budget", "largest", "Device bytes the models' weights may take on each "
                               "instance: 'largest' (the largest model's: the models take turns, and a switch to an "
                               "evicted one copies it from host memory), a number of bytes, or 'all' (every model stays).")
flags.register_validator("weight_budget", lambda v: v in ("all", "largest") or (v.isdigit() and int(v) > 0),
                         "must be 'largest', 'all' or a number of bytes")
_SIM = flags.DEFINE_bool("sim", True, "Also replay the paper's workload in the simulator on 8 x H200.")

QUESTION = "In two sentences: what does a coding agent do between two calls to its language model?"


class _Clock:
    """Prints each step with the seconds since the demo started."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:5.1f} s] {msg}", flush=True)


def _fmt(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.1f}"


def _first_answer(url: str, key: str, model: str, say: _Clock) -> None:
    """Streams one chat answer through the gateway, printing the text as it arrives."""
    import openai

    say(f"first answer: {model} through the gateway (its first step shapes compile) ...")
    print(f"  user: {QUESTION}\n  {model}: ", end="", flush=True)
    t = time.perf_counter()
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300) as client:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=48, temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    say(f"answered in {time.perf_counter() - t:.1f} s")


def _real_engines(say: _Clock, pols: list[str]) -> dict:
    from talaria_jax.engine.compile_cache import compile_seconds
    from talaria_jax.serve.load import summarize
    from talaria_jax.scheduler.policies import get_policy
    from talaria_jax.serve.local_cluster import KEY, MODELS, RANDOM, demo_cluster, demo_sessions

    say(f"loading {', '.join(MODELS)} on 2 instance servers (the GGUF is converted once, then read from the "
        f"cache) ...")
    script = demo_sessions(_SESSIONS.value, _CALLS.value, max_tokens=_MAX_TOKENS.value, tool_gap_s=_TOOL_GAP.value,
                           seed=_SEED.value)
    policies = [get_policy(p) for p in pols]
    with demo_cluster(pols[0], _WEIGHTS.value) as cluster:
        say(f"instances up at {', '.join(cluster.urls)}")
        with cluster.gateway(policies[0]) as url:
            _first_answer(url, KEY, MODELS[0], say)
        calls = sum(len(s.observations) for s in script)
        say(f"{len(script)} agent sessions ({calls} calls: " + ", ".join(f"{s.id} {s.model}" for s in script)
            + ") once under each policy, not measured: the step shapes they meet compile ...")
        # each policy once: a pass that finds the KV an earlier pass left meets shapes of its own
        # (host-KV page copies, prefills after a cached prefix), which would compile in a measured pass
        cluster.compare(policies, script, start_gap_s=_START_GAP.value, progress=True)

        compiled = {p: 0.0 for p in pols}  # seconds of compiling inside each policy's measured passes
        mark = compile_seconds()

        def report(policy: str, run: int, res) -> None:
            nonlocal mark
            s, c = summarize(res), compile_seconds()
            compiled[policy] += c - mark
            say(f"{policy}, pass {run + 1} of {_RUNS.value}: SCT p50 {_fmt(s['sct_p50_s'])} s, "
                f"p90 {_fmt(s['sct_p90_s'])} s, errors {s['errors']}, compiling {c - mark:.1f} s")
            mark = c

        say(f"measured: {_RUNS.value} passes per policy, interleaved ({', '.join(pols)}, ...)")
        runs = cluster.compare(policies, script, runs=_RUNS.value, on_run=report, start_gap_s=_START_GAP.value,
                               progress=True)
        stats = cluster.stats
    print("\nsession completion time (s) through the gateway on this machine, each pass:")
    print(f"| session | model | calls | {' | '.join(pols)} |")
    print("|---|---|---|" + "---|" * len(pols))
    by = {p: [{r.id: r for r in run} for run in runs[p]] for p in pols}
    for s in script:
        cells = [" / ".join(_fmt(b[s.id].sct_s) + (" (error)" if b[s.id].errors else "") for b in by[p])
                 for p in pols]
        print(f"| {s.id} | {s.model} | {len(s.observations)} | {' | '.join(cells)} |")
    sums = {p: [summarize(run) for run in runs[p]] for p in pols}
    for q in ("p50", "p90"):
        print(f"| {q} | | | " + " | ".join(" / ".join(_fmt(x[f"sct_{q}_s"]) for x in sums[p]) for p in pols) + " |")
    mean = {p: {q: float(np.mean([x[f"sct_{q}_s"] for x in sums[p]])) for q in ("p50", "p90")} for p in pols}
    # each policy's best pass: a pass that met step shapes no earlier pass compiled is not its fastest
    best = {p: {q: min(x[f"sct_{q}_s"] for x in sums[p]) for q in ("p50", "p90")} for p in pols}
    # the noise: how far one policy's own passes differ, relative to their mean
    noise = max(abs(a[f"sct_{q}_s"] - b[f"sct_{q}_s"]) / mean[p][q] for p in pols for q in ("p50", "p90")
                for a, b in zip(sums[p], sums[p][1:])) if _RUNS.value > 1 else math.nan
    switch_s = {p: stats[p]["switch_s"] / max(stats[p]["switches"], 1) for p in pols}
    switches = {p: (stats[p]["switches"], stats[p]["switch_max_s"]) for p in pols}
    real_calls = [c.e2e_s for run in runs[pols[0]] for r in run for c in r.calls
                  if r.model not in RANDOM and c.error is None]
    call_s = float(np.median(real_calls)) if real_calls else math.nan
    return {"best": best, "noise": noise, "switch_s": switch_s, "switches": switches, "call_s": call_s, "stats": stats, "compiled": compiled,
            "first": {s.id: by[pols[0]][0][s.id] for s in script}, "script": script, "random": RANDOM}


def _simulated(say: _Clock, pols: list[str]) -> dict:
    from talaria_jax.sim.compare import run_replay
    from talaria_jax.config_io import CONFIG_DIR

    trace = CONFIG_DIR / "traces" / "swebench-30x32.jsonl"
    say(f"the simulator: {trace.name} (30 SWE-bench-style sessions x 32 calls over three >100B models) on "
        f"h200x8, {', '.join(pols)}, seeds 0-2 ...")
    return {scale: run_replay(str(trace), "h200x8", pols, seeds=[0, 1, 2], tool_gap_scale=scale) for scale in (0.0, 1.0)}


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from talaria_jax.scheduler.policies import POLICIES

    pols = _POLICIES.value
    if any(p not in POLICIES for p in pols):
        raise app.UsageError(f"--policies: unknown {[p for p in pols if p not in POLICIES]}; "
                             f"known: {', '.join(POLICIES)}")
    say = _Clock()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start", flush=True)
    real = _real_engines(say, pols)
    a, rivals = pols[0], pols[1:]
    m, noise = real["best"], real["noise"]
    for b in rivals:  # each other policy over the first
        ratios = {q: m[b][q] / m[a][q] for q in ("p50", "p90")}
        if not math.isfinite(noise):
            verdict = "one pass per policy, so no noise was measured (--runs=2 for it)."
        elif all(abs(r - 1) <= noise for r in ratios.values()):
            verdict = f"one policy's passes differ by up to {noise:.0%}, so the policies differ by less than the noise."
        else:
            verdict = (f"one policy's passes differ by up to {noise:.0%}, and the policies by more at "
                       + ", ".join(q for q, r in ratios.items() if abs(r - 1) > noise) + ".")
        print(f"\n{b}/{a} SCT on this machine (best pass of each): p50 {ratios['p50']:.2f}x, "
              f"p90 {ratios['p90']:.2f}x; {verdict}")
    switches = ", ".join(f"{p} {real['switches'][p][0]} switches of {real['switch_s'][p]:.2f} s on average, the "
                         f"longest {real['switches'][p][1]:.2f} s" for p in pols)
    if _WEIGHTS.value == "all":
        print(f"Here every model stays on the devices, so a switch costs nothing ({switches}), and a SmolLM2 call "
              f"takes about {real['call_s']:.1f} s: a policy changes the order of the calls, not what a switch costs.")
    else:
        print(f"Here the models take turns on the devices (weight budget: {_WEIGHTS.value}), so a switch to an "
              f"evicted model copies its weights from host memory, as on a GPU ({switches}, measured over the "
              f"passes), and a SmolLM2 call takes about {real['call_s']:.1f} s.")
    print("Compiling inside the measured passes (step shapes the warm-up passes did not meet; the calls waiting "
          "on it count it): " + ", ".join(f"{p} {real['compiled'][p]:.1f} s" for p in pols) + ".")
    print(f"\nfirst replies ({a}):")
    for s in real["script"]:
        calls = real["first"][s.id].calls
        if s.model in real["random"]:
            reply = f"({calls[0].completion_tokens} tokens of random weights)" if calls else "-"
        else:
            reply = repr(calls[0].text.strip()[:110]) if calls else "-"
        print(f"  {s.id} [{s.model}] {reply}")
    if _SIM.value:
        sim = _simulated(say, pols)
        print("\nthe same policies simulated on 8 x H200 (means over seeds 0-2), SCT in s:")
        print(f"| tool gaps | {' | '.join(f'{p} p50 / p95' for p in pols)} | "
              + " | ".join(f"{b}/{a} p50 | {b}/{a} p95" for b in rivals) + " |")
        print("|---|" + "---|" * (3 * len(pols) - 2))
        for scale, res in sim.items():
            v = res["policies"]
            label = "none (the paper's regime)" if scale == 0 else "as measured (median 0.3 s, mean 18 s)"
            print(f"| {label} | " + " | ".join(f"{v[p]['sct_p50_s']:.0f} / {v[p]['sct_p95_s']:.0f}" for p in pols)
                  + "".join(f" | {v[b]['sct_p50_s'] / v[a]['sct_p50_s']:.2f}x | {v[b]['sct_p95_s'] / v[a]['sct_p95_s']:.2f}x"
                            for b in rivals) + " |")
        print("There a switch loads hundreds of GB of weights over PCIe (2-3 s) and a session's KV prefix is "
              "tens of thousands of tokens: keeping a model's sessions together, session-prefill and host KV "
              "pay, most when tool time does not hide the waits (docs/scheduler.md).")
    say("done")


def run():
    app.run(main)


if __name__ == "__main__":
    run()
