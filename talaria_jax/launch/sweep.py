"""`talaria-replay --sweep`: every policy in every cell of a regime matrix, and where talaria is not best.

Cells: tool-gap scale {0, 0.1, 0.25, 1} x hardware {h200x8, h100x8} x trace {the default trace file,
the generator at seeds 1-3, the traces of short, long and bimodal sessions (configs/traces/
short-30.jsonl, long-30.jsonl, bimodal-30.jsonl), a sparse one (`SPARSE`: short sessions arriving
far apart, tool waits of seconds) and one of sessions that use two models (`MULTI`)}, plus an open-arrival load sweep (30 default-style sessions
arriving at 0.02, 0.03 and 0.05 sessions/s on h200x8, tool gaps x1). Each cell replays every policy over the
same seeds. A cell is marked where a rival's p50 or p95 SCT is more than 2% below talaria's.

With `noise_seeds`, each cell also replays talaria over those other seeds and reports its SCT
there over its SCT on the sweep's seeds: the spread of the same policy between two sets of seeds,
to read the 2% tie against (a rival "faster" by less than that spread is not faster beyond noise).

`plot_heatmap` draws talaria's ratio over each rival per cell; `plot_timeline` draws one replay's
model slots per instance and each session's calls over time.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Sequence

import numpy as np

from talaria_jax.config_io import CONFIG_DIR
from talaria_jax.sim.compare import replay_calls, trace_shapes
from talaria_jax.sim.hardware import load_hardware
from talaria_jax.sim.traces import Trace, TraceSpec, generate, read_jsonl

SCALES = (0.0, 0.1, 0.25, 1.0)
HARDWARE = ("h200x8", "h100x8")
GENERATOR_SEEDS = (1, 2, 3)
LENGTH_TRACES = ("short", "long", "bimodal")  # configs/traces/<name>-30.jsonl: other session lengths
ARRIVAL_RATES = (0.02, 0.03, 0.05)  # sessions/s of the open-arrival load sweep
# Short sessions, sparse: 60 sessions of mostly 3-9 calls (median 5, at most 9) arriving one every
# 20 s on average, tool waits of seconds (median 3 s, p90 20 s): where holding room for a session's
# return has the least to gain (a coding agent's sub-tasks, or a team's agents spread over the day).
SPARSE = TraceSpec(sessions=60, turns=5, turns_sigma=0.35, max_turns=9, arrival_rate_per_s=0.05, gap_median_s=3.0,
                   gap_p90_s=20.0)
# Sessions that use two models: the default trace's sessions, each call after the first on a small
# helper model (gpt-oss-120b, 65 GB) with probability 1/4, the conversation continuing there (as
# Claude Code's opusplan runs one conversation on two models; docs/references.md "Agent sessions").
MULTI = TraceSpec(second_model_share=0.25, second_models=("gpt-oss-120b",))
TIE = 0.02  # a rival within 2% of talaria does not beat it


@dataclasses.dataclass(frozen=True)
class Cell:
    trace: str  # "default", "gen<seed>", "open<rate>", "sparse", "multi" or one of LENGTH_TRACES
    hardware: str
    tool_gap_scale: float

    @property
    def label(self) -> str:
        return f"{self.trace} {self.hardware} gaps x{self.tool_gap_scale:g}"


def cells(trace_names: Sequence[str] | None = None) -> list[Cell]:
    """The matrix, or its cells of `trace_names` (an unknown name raises ValueError listing the known)."""
    names = ["default"] + [f"gen{s}" for s in GENERATOR_SEEDS] + list(LENGTH_TRACES) + ["sparse", "multi"]
    out = [Cell(t, hw, sc) for t in names for hw in HARDWARE for sc in SCALES]
    out += [Cell(f"open{r:g}", "h200x8", 1.0) for r in ARRIVAL_RATES]
    known = list(dict.fromkeys(c.trace for c in out))
    unknown = [t for t in trace_names or () if t not in known]
    if unknown:
        raise ValueError(f"sweep traces {unknown} unknown; known: {', '.join(known)}")
    return [c for c in out if trace_names is None or c.trace in trace_names]


def cell_trace(name: str, default_path: str | pathlib.Path) -> Trace:
    if name == "default":
        return read_jsonl(default_path)
    if name in LENGTH_TRACES:
        return read_jsonl(CONFIG_DIR / "traces" / f"{name}-30.jsonl")
    if name in ("sparse", "multi"):
        spec = SPARSE if name == "sparse" else MULTI
    elif name.startswith("gen"):
        spec = TraceSpec(seed=int(name[3:]))
    elif name.startswith("open"):
        spec = TraceSpec(arrival_rate_per_s=float(name[4:]))
    else:
        raise ValueError(f"sweep trace {name!r}: not default, gen<seed>, open<rate>, sparse, multi or {', '.join(LENGTH_TRACES)}")
    return Trace(generate(spec), f"generated {spec}")


def run_sweep(policies: Sequence[str], seeds: Sequence[int], default_trace: str | pathlib.Path | None = None,
              trace_names: Sequence[str] | None = None, progress=print, noise_seeds: Sequence[int] = (),
              hints: str = "trace") -> dict:
    """Replays `policies` (talaria among them) in every cell; returns {"cells": [...]} with each cell's
    seed-averaged p50/p95 per policy, talaria's ratio over each rival and the rivals that beat it, and
    with `noise_seeds` talaria's SCT over those seeds divided by its SCT over `seeds` ("noise").
    `hints`: the agent hints the calls carry (a `traces.with_hints` mode)."""
    if "talaria" not in policies:
        raise ValueError("--sweep compares talaria with the other policies: put talaria in --policies")
    if set(noise_seeds) & set(seeds):
        raise ValueError(f"--noise_seeds {sorted(set(noise_seeds) & set(seeds))} are among --seeds: give other seeds")
    default_trace = default_trace or CONFIG_DIR / "traces" / "swebench-30x32.jsonl"
    traces: dict[str, Trace] = {}
    out = []
    todo = cells(trace_names)
    for k, cell in enumerate(todo, 1):
        if cell.trace not in traces:
            traces[cell.trace] = cell_trace(cell.trace, default_trace)
        calls, hw = traces[cell.trace], load_hardware(cell.hardware)
        res = replay_calls(calls, cell.trace, hw, trace_shapes(calls, hw), policies, seeds,
                           tool_gap_scale=cell.tool_gap_scale, hints=hints)
        sct = {n: (v["sct_p50_s"], v["sct_p95_s"]) for n, v in res["policies"].items()}
        ratio, beaten_by = compare(sct)
        t50, t95 = sct["talaria"]
        out.append({"cell": dataclasses.asdict(cell), "label": cell.label, "sct": sct, "ratio": ratio,
                    "beaten_by": beaten_by, "floor": (res["floor"]["sct_p50_s"], res["floor"]["sct_p95_s"])})
        if noise_seeds:
            other = replay_calls(calls, cell.trace, hw, trace_shapes(calls, hw), ["talaria"], noise_seeds,
                                 tool_gap_scale=cell.tool_gap_scale, hints=hints)["policies"]["talaria"]
            out[-1]["noise"] = (other["sct_p50_s"] / t50, other["sct_p95_s"] / t95)
        progress(f"[{k}/{len(todo)}] {cell.label}: talaria {t50:.0f} / {t95:.0f} s"
                 + (f", beaten by {', '.join(beaten_by)}" if beaten_by else ", best"))
    return {"policies": list(policies), "seeds": list(seeds), "noise_seeds": list(noise_seeds), "tie": TIE,
            "hints": hints, "cells": out}


def compare(sct: dict[str, tuple[float, float]], tie: float = TIE) -> tuple[dict, list[str]]:
    """From each policy's (p50, p95): each rival's SCT over talaria's, and the rivals more than `tie`
    faster than talaria at p50 or at p95."""
    t50, t95 = sct["talaria"]
    ratio = {n: (p50 / t50, p95 / t95) for n, (p50, p95) in sct.items() if n != "talaria"}
    return ratio, [n for n, (r50, r95) in ratio.items() if r50 < 1 - tie or r95 < 1 - tie]


def dominated_by(ratio: dict[str, tuple[float, float]], tie: float = TIE) -> list[str]:
    """The rivals more than `tie` faster than talaria at p50 and at p95 both."""
    return [n for n, (r50, r95) in ratio.items() if r50 < 1 - tie and r95 < 1 - tie]


def format_sweep(res: dict) -> str:
    """One row per cell: talaria's p50/p95, its ratio over each rival (rival SCT / talaria SCT at p50 /
    p95: above 1 means talaria is faster) and a mark where a rival beats it by more than the tie; with
    noise seeds, talaria over them / talaria over the sweep's seeds, `~` where that passes the tie."""
    rivals = [p for p in res["policies"] if p != "talaria"]
    noise = bool(res.get("noise_seeds"))
    lines = [f"seeds {','.join(map(str, res['seeds']))} (means); cells: rival SCT / talaria SCT at p50 / p95; "
             f"`!` marks a rival more than {res['tie']:.0%} faster than talaria", "",
             "| cell | talaria p50 / p95 (s) | floor p50 / p95 (s) | " + " | ".join(rivals)
             + (f" | talaria, seeds {','.join(map(str, res['noise_seeds']))}" if noise else "") + " | talaria best |",
             "|---|---:|---:|" + "---:|" * (len(rivals) + noise) + "---|"]
    off = lambda r: abs(r - 1) > res["tie"]
    for c in res["cells"]:
        t50, t95 = c["sct"]["talaria"]
        row = []
        for n in rivals:
            r50, r95 = c["ratio"][n]
            mark = lambda r: f"{r:.2f}" + ("!" if r < 1 - res["tie"] else "")
            row.append(f"{mark(r50)} / {mark(r95)}")
        if noise:
            row.append(" / ".join(f"{r:.2f}" + ("~" if off(r) else "") for r in c["noise"]))
        best = "yes" if not c["beaten_by"] else "no: " + ", ".join(c["beaten_by"])
        lines.append(f"| {c['label']} | {t50:.0f} / {t95:.0f} | {c['floor'][0]:.0f} / {c['floor'][1]:.0f} | "
                     + " | ".join(row) + f" | {best} |")
    n_best = sum(not c["beaten_by"] for c in res["cells"])
    n_free = sum(not dominated_by(c["ratio"], res["tie"]) for c in res["cells"])
    lines += ["", f"talaria best (p50 and p95, ties within {res['tie']:.0%}) in {n_best} of {len(res['cells'])} cells; "
              f"no rival faster at both p50 and p95 in {n_free}"]
    if noise:
        n50, n95 = (sum(off(c["noise"][q]) for c in res["cells"]) for q in (0, 1))
        lines.append(f"talaria over seeds {','.join(map(str, res['noise_seeds']))} differs from itself over seeds "
                     f"{','.join(map(str, res['seeds']))} by more than the tie in {n50} cells at p50 and {n95} at p95")
    return "\n".join(lines)


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib (pip install matplotlib)") from None
    return plt


def plot_heatmap(res: dict, path: str) -> None:
    """Two panels (p50, p95): rows are cells, columns rivals, colour and number the rival/talaria ratio."""
    plt = pyplot()
    rivals = [p for p in res["policies"] if p != "talaria"]
    labels = [c["label"] for c in res["cells"]]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.3 * len(rivals), 1.5 + 0.28 * len(labels)), sharey=True)
    for ax, q, title in zip(axes, (0, 1), ("p50", "p95")):
        m = np.array([[c["ratio"][n][q] for n in rivals] for c in res["cells"]])
        im = ax.imshow(np.log2(m), cmap="RdBu", vmin=-2, vmax=2, aspect="auto")
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(rivals)), rivals, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(f"rival SCT / talaria SCT, {title} (blue: talaria faster)", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.6, label="log2 ratio")
    fig.savefig(path, dpi=130, bbox_inches="tight")


def plot_timeline(runs: dict, path: str) -> None:
    """`runs`: policy -> ReplayResult. Per policy, each instance's model slots (switch time hatched)
    and, below, each session's calls (issue to completion) coloured by model."""
    plt = pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.5 + 0.09 * sum(len(r.sct_s) for r in runs.values())),
                             squeeze=False, sharex=True)
    models = sorted({rec.model for r in runs.values() for rec in r.records})
    colour = {m: plt.cm.tab10(k % 10) for k, m in enumerate(models)}
    for ax, (name, r) in zip(axes[:, 0], runs.items()):
        start = min(rec.issued_s for rec in r.records)
        rows = [inst.name for inst in r.instances]
        for k, inst in enumerate(r.instances):
            log = inst.stats.switch_log
            for j, (t, m, dur) in enumerate(log):
                end = log[j + 1][0] if j + 1 < len(log) else start + r.makespan_s
                ax.barh(k, end - t, left=t - start, color=colour[m], height=0.8)
                ax.barh(k, dur, left=t - start, color="white", hatch="////", edgecolor=colour[m], height=0.8)
        sessions = sorted({rec.session for rec in r.records})
        row_of = {s: len(rows) + k for k, s in enumerate(sessions)}
        for rec in r.records:
            ax.barh(row_of[rec.session], rec.done_s - rec.issued_s, left=rec.issued_s - start, height=0.6,
                    color=colour.get(rec.model, "grey"))
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        ax.invert_yaxis()
        ax.set_ylabel("instances, then sessions", fontsize=7)
        p = np.quantile(list(r.sct_s.values()), [0.5, 0.95])
        ax.set_title(f"{name}: SCT p50 {p[0]:.0f} s, p95 {p[1]:.0f} s", fontsize=8)
    axes[-1, 0].set_xlabel("time since the first call (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[m]) for m in models]
    fig.legend(handles, models, loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
