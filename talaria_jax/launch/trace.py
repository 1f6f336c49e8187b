"""talaria-trace: generate an agent-session trace (docs/traces.md) and print its statistics.

    python -m talaria_jax.launch.trace --sessions=30 --turns=32 --seed=0 --out=out/trace.jsonl
    python -m talaria_jax.launch.trace --sessions=8 --turns=150 --models=glm-4.5-air,gpt-oss-120b \
        --compact_at_tokens=32000 --out=out/compacting.jsonl

Writes one call per line (``talaria_jax.sim.traces.write_jsonl``), then prints the trace's
``summary()`` as a table. Every other setting is ``TraceSpec``'s default (docs/references.md's agent
statistics). A model must be a variant of configs/hardware/models.yaml or a config name under
configs/models/ (replayed in bf16), the names talaria-replay accepts. A bad flag ends with one line,
``talaria-trace: error: ...``, and exit 2.

The flags live in their own ``FlagValues`` (not absl's global FLAGS): several of their names (seed,
models, sessions, out, tool_gap_scale) are flags of other launchers that one process may import.
"""
from __future__ import annotations

import pathlib
import sys
from typing import Sequence

from absl import flags

from talaria_jax.models.config import available_models
from talaria_jax.sim.hardware import ConfigError, load_models
from talaria_jax.sim.traces import TraceError, TraceSpec, generate, summary, with_hints, write_jsonl

FLAGS = flags.FlagValues()
_D = TraceSpec()
flags.DEFINE_integer("sessions", _D.sessions, "Agent sessions.", flag_values=FLAGS)
flags.DEFINE_integer("turns", _D.turns, "LLM calls per session (the median with --turns_sigma).", flag_values=FLAGS)
flags.DEFINE_float("turns_sigma", _D.turns_sigma, "Lognormal sigma of calls per session (0: every session makes "
                   "--turns).", flag_values=FLAGS)
flags.DEFINE_integer("long_turns", _D.long_turns, "With --long_share: the median calls of the long sessions.",
                     flag_values=FLAGS)
flags.DEFINE_float("long_share", _D.long_share, "Share of sessions around --long_turns calls instead of --turns "
                   "(a bimodal mix).", flag_values=FLAGS)
flags.DEFINE_list("models", list(_D.models), "Models in order of popularity (Zipf s=1 over this order): variants "
                  "of configs/hardware/models.yaml or config names under configs/models/.", flag_values=FLAGS)
flags.DEFINE_float("second_model_share", _D.second_model_share, "Share of each session's calls after its first that "
                   "run on a second model (0: sessions keep one model).", flag_values=FLAGS)
flags.DEFINE_list("second_models", list(_D.second_models), "With --second_model_share: the models a session's second "
                  "model is drawn from (a small helper); empty: another of --models.", flag_values=FLAGS)
flags.DEFINE_float("arrival_rate", _D.arrival_rate_per_s, "Poisson session arrivals per second.", flag_values=FLAGS)
flags.DEFINE_integer("seed", _D.seed, "Seed of every draw; the same flags give the same trace.", flag_values=FLAGS)
flags.DEFINE_string("out", "", "The JSONL file to write.", flag_values=FLAGS)
flags.DEFINE_integer("compact_at_tokens", _D.compact_at_tokens, "Compact a session's context when its next prompt "
                     "would exceed this many tokens: keep its first prompt as the prefix, plus a "
                     f"{_D.compact_summary_tokens}-token summary (0: only at max_context_tokens="
                     f"{_D.max_context_tokens}).", flag_values=FLAGS)
flags.DEFINE_float("tool_gap_scale", _D.tool_gap_scale, "Multiply every drawn tool gap by this (>= 0).",
                   flag_values=FLAGS)
flags.DEFINE_bool("hints", False, "Give every call the agent hints an agent that knows its plan would send: the "
                  "calls its session makes after it and its tool time (docs/serving.md \"Agent hints\").",
                  flag_values=FLAGS)
flags.DEFINE_bool("help", False, "Show this help.", short_name="h", flag_values=FLAGS)


class _Usage(Exception):
    pass


def spec_from_flags() -> TraceSpec:
    """The ``TraceSpec`` the parsed flags describe; a bad value raises ``_Usage`` naming the flag."""
    if not FLAGS.out:
        raise _Usage("--out: give the JSONL file to write")
    if not FLAGS.arrival_rate > 0:
        raise _Usage(f"--arrival_rate={FLAGS.arrival_rate} must be > 0")
    for name in ("sessions", "turns"):
        if FLAGS[name].value < 1:
            raise _Usage(f"--{name}={FLAGS[name].value} must be >= 1")
    models = tuple(m.strip() for m in FLAGS.models)
    if not models or not all(models):
        raise _Usage(f"--models={','.join(FLAGS.models)!r}: give one or more model names")
    if len(set(models)) != len(models):
        raise _Usage(f"--models: {','.join(models)} names a model twice")
    second = tuple(m.strip() for m in FLAGS.second_models if m.strip())
    known = set(load_models()) | set(available_models())
    for flag, m in [("models", m) for m in models] + [("second_models", m) for m in second]:
        if m not in known:
            raise _Usage(f"--{flag}: {m!r} is neither a variant of configs/hardware/models.yaml nor a config under "
                         f"configs/models/ (known: {', '.join(sorted(known))})")
    try:
        return TraceSpec(sessions=FLAGS.sessions, turns=FLAGS.turns, turns_sigma=FLAGS.turns_sigma,
                         long_turns=FLAGS.long_turns, long_share=FLAGS.long_share, models=models,
                         second_model_share=FLAGS.second_model_share, second_models=second,
                         arrival_rate_per_s=FLAGS.arrival_rate, seed=FLAGS.seed,
                         compact_at_tokens=FLAGS.compact_at_tokens, tool_gap_scale=FLAGS.tool_gap_scale)
    except TraceError as e:  # names the TraceSpec field: the flag of the same name
        raise _Usage(str(e)) from None


def format_summary(s: dict) -> str:
    """A markdown table of ``summary()``."""
    per_model = ", ".join(f"{m} {n}" for m, n in sorted(s["sessions_per_model"].items(), key=lambda x: -x[1]))
    rows = [("sessions", s["sessions"]), ("calls", s["calls"]), ("sessions per model", per_model),
            ("sessions using two or more models", s["multi_model_sessions"]),
            ("calls per session, median / p90 / max", " / ".join(map(str, s["calls_per_session"]))),
            ("output tokens, mean", f"{s['output_tokens_mean']:.0f}"),
            ("tool gap median / p90 / mean (s)",
             f"{s['tool_gap_median_s']:.2f} / {s['tool_gap_p90_s']:.1f} / {s['tool_gap_mean_s']:.1f}"),
            ("deepest context per session, mean / max (tokens)",
             f"{s['deepest_context_mean']:.0f} / {s['deepest_context_max']}"),
            ("prefix reuse (of input tokens)", f"{s['prefix_reuse_fraction']:.1%}"),
            ("compactions (calls with prefix_tokens)", s["compactions"]),
            ("last session start (s)", f"{s['last_start_s']:.1f}")]
    return "\n".join(["| statistic | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def main(argv: Sequence[str]) -> int:
    """Parses `argv` (argv[0] is the program), writes the trace and prints its summary; returns 0, or
    prints one error line and exits 2."""
    try:
        try:
            rest = FLAGS(list(argv))
        except flags.Error as e:
            raise _Usage(str(e)) from None
        if FLAGS.help:
            print(__doc__.split("\n\n")[0] + "\n\nFlags:")
            for name in sorted(FLAGS):
                if name == FLAGS[name].name:  # not a short name
                    print(f"  --{name}: {FLAGS[name].help} (default: {FLAGS[name].default_as_str})")
            return 0
        if len(rest) > 1:
            raise _Usage(f"unexpected arguments: {rest[1:]}")
        spec = spec_from_flags()
        calls = generate(spec)
        if FLAGS.hints:
            calls = with_hints(calls, "true")
        out = pathlib.Path(FLAGS.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(calls, out)
    except (_Usage, ConfigError, OSError) as e:
        print(f"talaria-trace: error: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
        sys.exit(2)
    finally:
        FLAGS.unparse_flags()
    print(f"wrote {out}: {len(calls)} calls")
    print(format_summary(summary(calls)))
    return 0


def run() -> None:
    """Console-script entry point (talaria-trace)."""
    sys.exit(main(sys.argv))


if __name__ == "__main__":
    run()
