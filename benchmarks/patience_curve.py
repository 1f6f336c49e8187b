"""The p50/p95 knob: talaria's SCT p50 and p95 over `PolicyConfig.patience` (how long a waiting
call waits, in units of the slot order's bound, before it ages and its model goes first), with
round, talaria-chain and composite for reference, in the simulator (h200x8, means over seeds 0-4) on
the default trace and on traces of short, long and bimodal sessions, with tool gaps as drawn (x1),
a quarter of them and none (x0). Prints a table per cell and draws the curves; the table and the
plot are in docs/scheduler.md "The p50/p95 knob".

  .venv/bin/python -m benchmarks.patience_curve --plot=docs/patience.png     # about 3.5 minutes on one core
"""
from __future__ import annotations

import argparse
import math

from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.sim.compare import run_replay

TRACES = {"default": "swebench-30x32.jsonl", "short": "short-30.jsonl", "long": "long-30.jsonl",
          "bimodal": "bimodal-30.jsonl"}
GAPS = (1.0, 0.25, 0.0)
PATIENCE = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 16.0, math.inf)
RIVALS = ("round", "talaria-chain", "composite")
SEEDS = [0, 1, 2, 3, 4]


def measure() -> dict:
    """{(trace, gaps): {label: (p50, p95)}} with labels "patience=x" and the rivals' names."""
    out = {}
    for name, file in TRACES.items():
        for gaps in GAPS:
            pols = [f"talaria[patience={p}]" for p in PATIENCE] + list(RIVALS)
            res = run_replay(str(CONFIG_DIR / "traces" / file), "h200x8", pols, SEEDS, tool_gap_scale=gaps)
            out[(name, gaps)] = {(f"patience={p:g}" if pol.startswith("talaria[") else pol): (v["sct_p50_s"], v["sct_p95_s"])
                                 for p, (pol, v) in zip(list(PATIENCE) + [None] * len(RIVALS), res["policies"].items())}
            print(f"{name} x{gaps:g}: " + ", ".join(f"{k} {a:.0f}/{b:.0f}" for k, (a, b) in out[(name, gaps)].items()),
                  flush=True)
    return out


def table(out: dict) -> str:
    labels = [f"patience={p:g}" for p in PATIENCE]
    rows = ["| trace | tool gaps | " + " | ".join(l.split("=")[1] for l in labels) + " | " + " | ".join(RIVALS)
            + " | dominates 1 |", "|---|---|" + "---:|" * (len(labels) + len(RIVALS)) + "---|"]
    for (name, gaps), v in out.items():
        d = v["patience=1"]
        dom = [l.split("=")[1] for l in labels if v[l][0] < d[0] and v[l][1] < d[1]]
        rows.append(f"| {name} | x{gaps:g} | " + " | ".join(f"{v[l][0]:.0f} / {v[l][1]:.0f}" for l in labels + list(RIVALS))
                    + f" | {', '.join(dom) or '-'} |")
    return "\n".join(rows)


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(GAPS), len(TRACES), figsize=(4 * len(TRACES), 3.4 * len(GAPS)))
    for (name, gaps), v in out.items():
        ax = axes[GAPS.index(gaps)][list(TRACES).index(name)]
        pts = [v[f"patience={p:g}"] for p in PATIENCE]
        ax.plot([a for a, _ in pts], [b for _, b in pts], "o-", color="tab:blue", label="talaria, patience 0 .. inf")
        for p, (a, b) in zip(PATIENCE, pts):
            ax.annotate(f"{p:g}", (a, b), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.plot(*v["patience=1"], "*", color="tab:blue", markersize=14, label="default (patience 1)")
        for r, mark in zip(RIVALS, "sDv"):
            ax.plot(*v[r], mark, label=r)
        ax.set_title(f"{name}, tool gaps x{gaps:g}", fontsize=9)
        ax.set_xlabel("SCT p50 (s)", fontsize=8)
        ax.set_ylabel("SCT p95 (s)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", default="", help="write the curves here (PNG)")
    args = ap.parse_args()
    out = measure()
    print(table(out))
    if args.plot:
        plot(out, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
