"""Tunix's GRPO learner with talaria's rollout engine, on a CPU, in a few minutes.

The task is grpo_toy.py's: answer in digits. Prompts are questions ("q: 17+5=? a:") in a
character vocabulary (49 of 56 ids used); the reward of a completion is the share of its characters that
are digits (an empty one scores 0). The policy is a tiny random Tunix Llama3 (2 layers, width 64),
so it starts near a reward of 0.2 and has everything to learn.

The only line that differs from a Tunix user's own GRPO script is `rollout_engine`:

    rollout_engine=functools.partial(TalariaRollout, replicas=2)    # --rollout=talaria
    rollout_engine="vanilla"                                         # --rollout=vanilla

With talaria the rollouts run on a RolloutService over two engines (one device each of the rollout
mesh), with cache-aware placement keeping each question's group together; after every optimizer step
Tunix's learner calls `update_params`, which reshards the trainer's weights onto both replicas.

  .venv/bin/python examples/tunix_grpo.py                          # talaria, 20 steps
  .venv/bin/python examples/tunix_grpo.py --rollout=vanilla        # Tunix's own sampler
  .venv/bin/python examples/tunix_grpo.py --plot=docs/tunix_grpo.png --compare   # both, one plot
"""
from __future__ import annotations

import os

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import functools
import time

import numpy as np
from absl import app, flags

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=?:.,!-'"
DIGITS = set("0123456789")


class CharTokenizer:
    """One token per character; 0 pad, 1 BOS, 2 EOS (what Tunix's TokenizerAdapter asks of a tokenizer)."""

    def encode(self, text: str, **kw) -> list[int]:
        return [3 + CHARS.index(c) for c in str(text).lower() if c in CHARS]

    def decode(self, ids, **kw) -> str:
        return "".join(CHARS[i - 3] for i in ids if 3 <= i < 3 + len(CHARS))

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return 2

    def pad_id(self) -> int:
        return 0


VOCAB = 56  # 3 + len(CHARS), rounded up to a multiple of 8: Tunix shards the vocabulary over the rollout mesh


def questions(seed: int, k: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"q: {a}+{b}=? a:" for a, b in rng.integers(0, 50, (k, 2))]


def digit_share(completions: list[str]) -> list[float]:
    return [sum(c in DIGITS for c in text) / len(text) if text else 0.0 for text in completions]


def randomize(model, seed: int, scale: float = 0.1):
    """`model` with every matrix drawn from N(0, scale^2) (Tunix starts its MLPs at zero); norms kept."""
    import jax
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda x: x if x.ndim < 2 else scale * jax.random.normal(next(keys), x.shape),
                                   state))
    return model


def tiny_llama(seed: int = 0):
    """A 2-layer Tunix Llama3 over the character vocabulary, random."""
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    cfg = llama3.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, hidden_dim=128, num_heads=4,
                             head_dim=16, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-5, weight_tying=False)
    return randomize(llama3.Llama3(cfg, rngs=nnx.Rngs(seed)), seed)


def train(rollout: str, steps: int, seed: int = 0, group: int = 4, prompts_per_step: int = 4,
          max_tokens: int = 12, lr: float = 3e-3, log=print) -> list[float]:
    """Runs Tunix's GRPOLearner for `steps` steps with `rollout` ("talaria" or "vanilla"); the mean
    reward of each step's rollouts, in order."""
    import grain.python as grain
    import jax
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from talaria_jax.rollout.tunix_rollout import TalariaRollout

    devices = jax.devices()
    auto = (jax.sharding.AxisType.Auto,) * 2  # Tunix's trainer constrains shardings by axis name
    actor_mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=devices[:1], axis_types=auto)
    rollout_mesh = jax.make_mesh((1, 2), ("fsdp", "tp"), devices=devices[1:3], axis_types=auto)
    engine = functools.partial(TalariaRollout, replicas=2, max_seqs=8) if rollout == "talaria" else "vanilla"
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: actor_mesh, rl_cluster_lib.Role.REFERENCE: actor_mesh,
                      rl_cluster_lib.Role.ROLLOUT: rollout_mesh},
        rollout_engine=engine,
        training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.adam(lr), max_steps=steps,
                                                        eval_every_n_steps=10 * steps),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=max_tokens, max_prompt_length=16,
                                                  kv_cache_size=64, temperature=1.0, top_p=1.0,
                                                  return_logprobs=True))
    cluster = rl_cluster_lib.RLCluster(actor=tiny_llama(seed), tokenizer=CharTokenizer(), cluster_config=config)
    rewards, t0 = [], time.perf_counter()

    def reward(prompts, completions, **kw):
        r = digit_share(completions)
        rewards.append(float(np.mean(r)))
        log(f"[{time.perf_counter() - t0:6.1f} s] {rollout} step {len(rewards):2d}: mean reward {rewards[-1]:.3f}  "
            f"e.g. {completions[0]!r}")
        return r

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=reward,
                                       algo_config=grpo_learner.GRPOConfig(num_generations=group, beta=0.0))
    data = (grain.MapDataset.source(questions(seed, steps * prompts_per_step)).batch(prompts_per_step)
            .map(lambda x: {"prompts": x}))
    learner.train(data)
    close = getattr(cluster.rollout, "close", None)
    if close is not None:
        close()
    return rewards


def plot(curves: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in curves.items():
        ax.plot(np.arange(1, len(r) + 1), r, marker="o", ms=3, label=f"{name} rollout")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward (digit share)")
    ax.set_title("Tunix GRPOLearner, tiny Llama3, CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    curves = {}
    for name in (["talaria", "vanilla"] if f.compare else [f.rollout]):
        t = time.perf_counter()
        curves[name] = train(name, f.steps, f.seed)
        r = curves[name]
        k = max(1, len(r) // 4)
        print(f"{name}: mean reward of the first {k} steps {np.mean(r[:k]):.3f}, of the last {k} {np.mean(r[-k:]):.3f} "
              f"({time.perf_counter() - t:.0f} s)")
    if f.plot:
        plot(curves, f.plot)
        print(f"wrote {f.plot}")


if __name__ == "__main__":  # flags only when run: tests import this module beside other flag owners
    flags.DEFINE_enum("rollout", "talaria", ["talaria", "vanilla"], "Tunix rollout engine")
    flags.DEFINE_bool("compare", False, "run both rollout engines, talaria first")
    flags.DEFINE_integer("steps", 20, "GRPO steps")
    flags.DEFINE_integer("seed", 0, "model and data seed")
    flags.DEFINE_string("plot", None, "write the reward curves to this PNG")
    app.run(main)
