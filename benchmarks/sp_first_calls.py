"""Session-prefill for first calls: talaria (whose session-prefill admits a new session's first
call of the active model too) against talaria-sp-continuations (session-prefill admits only the
continuations of the sessions, as the paper defines it), in the simulator over the default,
co-resident, short, long and bimodal traces x h200x8 / h100x8 x tool gaps x1, x0.25, x0; means over
seeds 0-4. The table and its reading are in docs/scheduler.md "Session-prefill".

  .venv/bin/python -m benchmarks.sp_first_calls      # about 2 minutes on one core
"""
from __future__ import annotations

from benchmarks import common
from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.sim.compare import run_replay

TRACES = {"default": "swebench-30x32.jsonl", "coresident": "swebench-30x32-coresident.jsonl",
          "short": "short-30.jsonl", "long": "long-30.jsonl", "bimodal": "bimodal-30.jsonl"}


def main() -> None:
    r50, r95 = [], []
    print(common.markdown_header(["trace", "hardware", "tool gaps", "talaria-sp-continuations", "talaria",
                                  "talaria / sp-continuations p50 / p95"]))
    for hw in ("h200x8", "h100x8"):
        for name, file in TRACES.items():
            for gaps in (1.0, 0.25, 0.0):
                res = run_replay(str(CONFIG_DIR / "traces" / file), hw, ["talaria-sp-continuations", "talaria"],
                                 [0, 1, 2, 3, 4], tool_gap_scale=gaps)["policies"]
                a, b = res["talaria-sp-continuations"], res["talaria"]
                r50.append(b["sct_p50_s"] / a["sct_p50_s"])
                r95.append(b["sct_p95_s"] / a["sct_p95_s"])
                print(f"| {name} | {hw} | x{gaps:g} | {a['sct_p50_s']:.0f} / {a['sct_p95_s']:.0f} | "
                      f"{b['sct_p50_s']:.0f} / {b['sct_p95_s']:.0f} | {r50[-1]:.3f} / {r95[-1]:.3f} |", flush=True)
    count = lambda v, f: sum(1 for x in v if f(x))
    print(f"\ngeometric mean talaria / sp-continuations: p50 {common.geomean(r50):.3f}, p95 {common.geomean(r95):.3f}; "
          f"of {len(r50)} cells "
          f"p50 better by > 2% in {count(r50, lambda x: x < 0.98)}, worse in {count(r50, lambda x: x > 1.02)}; "
          f"p95 better in {count(r95, lambda x: x < 0.98)}, worse in {count(r95, lambda x: x > 1.02)}")


if __name__ == "__main__":
    main()
