"""Records multi-turn trajectories of SmolLM2-135M-Instruct in the toy agentic environment
(talaria_jax.rollout.agent_env): `--samples_per_task` sibling trajectories of each task, all advanced one
turn per engine batch, written with a header (the command, the flags, the model's vocabulary and stop
tokens, each task's first messages) to `--out`, the recording spec_decode.py and suffix_vs_arctic.py replay.

  .venv/bin/python -m benchmarks.record_trajectories     # rewrites benchmarks/data/agent_trajectories.json
"""
from __future__ import annotations

import datetime
import shlex
import sys
import time

from absl import app, flags, logging

from benchmarks import common
from talaria_jax.rollout import agent_env

_TASKS = flags.DEFINE_list("tasks", list(agent_env.TASKS), f"Task ids, of {', '.join(agent_env.TASKS)}.")
_SAMPLES = flags.DEFINE_integer("samples_per_task", 4, "Sibling trajectories per task.", lower_bound=1)
_MAX_TURNS = flags.DEFINE_integer("max_turns", 5, "Model turns per trajectory at most.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 96, "Tokens per reply at most.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature.", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the engine and of every trajectory's sampling.", lower_bound=0)
_OUT = flags.DEFINE_string("out", str(common.TRAJECTORIES), "Where to write the trajectories (.json, or .json.gz).")
FLAGS = (_TASKS, _SAMPLES, _MAX_TURNS, _MAX_TOKENS, _TEMPERATURE, _SEED, _OUT)


def main(argv):
    del argv
    from talaria_jax.launch.common import load_on_devices

    logging.set_verbosity(logging.WARNING)
    unknown = [t for t in _TASKS.value if t not in agent_env.TASKS]
    if unknown:
        raise app.UsageError(f"--tasks: unknown {unknown}; known: {', '.join(agent_env.TASKS)}")
    t0 = time.perf_counter()
    lm = load_on_devices(agent_env.MODEL, 1, dtype=None, compilation_cache=None)
    trajectories = agent_env.record(lm, [agent_env.TASKS[t] for t in _TASKS.value], _SAMPLES.value, _MAX_TURNS.value,
                                    _MAX_TOKENS.value, _TEMPERATURE.value, _SEED.value)
    command = shlex.join(["python", "-m", "benchmarks.record_trajectories", *sys.argv[1:]])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    header = dict(model=agent_env.MODEL, command=command, seed=_SEED.value, date=date,
                  flags={f.name: f.value for f in FLAGS}, vocab_size=lm.cfg.vocab_size, eos_ids=list(lm.cfg.eos_ids),
                  max_model_len=agent_env.MAX_MODEL_LEN,
                  first_messages={t: agent_env.first_messages(agent_env.TASKS[t]) for t in _TASKS.value})
    size = agent_env.save_trajectories(_OUT.value, header, trajectories)
    print(f"{agent_env.summary(trajectories)}; wrote {_OUT.value} ({size / 1024:.0f} KiB) in "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    app.run(main)
