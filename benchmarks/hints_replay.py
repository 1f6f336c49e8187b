"""Agent hints in the simulated replay: talaria's SCT with no hints, wrong hints, only the end of
each session, and true hints (`talaria-replay --hints=...`), on the default trace and on traces of
short, long and bimodal sessions, with tool gaps as drawn (x1) and without tool time (x0); h200x8,
means over seeds 0-4. The noise column replays no hints over seeds 5-9: how far the figures move on
other jitter draws alone. The table and its reading are in docs/serving.md "Agent hints".

  .venv/bin/python -m benchmarks.hints_replay      # about 1.5 minutes on one core
"""
from __future__ import annotations

from benchmarks import common
from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.sim.compare import run_replay

TRACES = {"default": "swebench-30x32.jsonl", "short": "short-30.jsonl", "long": "long-30.jsonl",
          "bimodal": "bimodal-30.jsonl"}
SEEDS, NOISE_SEEDS = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]


def main() -> None:
    print(common.markdown_header(["trace", "tool gaps", "no hints", "wrong", "ends only", "true", "wrong / none",
                                  "true / none", "noise (no hints, seeds 5-9 / 0-4)", "round", "composite"]))
    for name, file in TRACES.items():
        path = str(CONFIG_DIR / "traces" / file)
        for gaps in (1.0, 0.0):
            run = lambda hints, policies, seeds: run_replay(path, "h200x8", policies, seeds, tool_gap_scale=gaps,
                                                            hints=hints)["policies"]
            base = run("none", ["talaria", "round", "composite"], SEEDS)
            t = {h: run(h, ["talaria"], SEEDS)["talaria"] for h in ("wrong", "ends", "true")}
            t["none"], noise = base["talaria"], run("none", ["talaria"], NOISE_SEEDS)["talaria"]
            f = lambda v: f"{v['sct_p50_s']:.0f} / {v['sct_p95_s']:.0f}"
            r = lambda a, b: f"{a['sct_p50_s'] / b['sct_p50_s']:.2f} / {a['sct_p95_s'] / b['sct_p95_s']:.2f}"
            print(f"| {name} | x{gaps:g} | {f(t['none'])} | {f(t['wrong'])} | {f(t['ends'])} | {f(t['true'])} | "
                  f"{r(t['wrong'], t['none'])} | {r(t['true'], t['none'])} | {r(noise, t['none'])} | "
                  f"{f(base['round'])} | {f(base['composite'])} |", flush=True)


if __name__ == "__main__":
    main()
