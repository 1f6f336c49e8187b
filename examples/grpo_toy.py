"""A small GRPO loop in JAX with optax, on the rollout service: rollouts from two replicas, the new
weights pushed back with `update_weights` after every optimizer step.

The task: answer in digits. Each prompt is a byte-encoded question ("Q: 17+5=? A:"); the reward of
an answer is the share of its tokens that are ASCII digits (an answer that is all digits scores 1).
The policy starts as a tiny random decoder (configs/models/tiny-dense.yaml, 4 layers, byte
vocabulary), so it begins near 10/512 and has everything to learn; GRPO (group-relative
advantages, a clipped policy ratio, no value model and no KL term) teaches it within a few minutes
on a CPU.

Every step: `service.generate(prompts, n=group)` samples the groups over the replicas (the
logprobs come back with the tokens), the trainer recomputes the same logprobs under its copy of the
weights (they agree to ~1e-6: printed), takes `--epochs` Adam steps on the GRPO loss and calls
`service.update_weights(state)`, which reshards the new parameters onto each replica's mesh.

  .venv/bin/python examples/grpo_toy.py                      # 30 steps, ~2-3 min on 2 cores
  .venv/bin/python examples/grpo_toy.py --steps=40 --plot=docs/grpo_toy.png
"""
from __future__ import annotations

import os

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # two replicas of 4 simulated devices when run on a CPU (a no-op on GPUs)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import functools
import time
import types

import numpy as np
from absl import app, flags

DIGITS = np.arange(ord("0"), ord("9") + 1)


def questions(rng: np.random.Generator, k: int) -> list[str]:
    return [f"Q: {a}+{b}=? A:" for a, b in rng.integers(0, 50, (k, 2))]


def reward(token_ids: list[int], finish_reason: str) -> float:
    """The share of the answer's tokens that are ASCII digits (a final stop token is not part of it)."""
    answer = token_ids[:-1] if finish_reason == "stop" else token_ids
    return float(np.isin(answer, DIGITS).mean()) if answer else 0.0


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """GRPO: each sample's reward against its group's mean, in units of the group's spread."""
    return (rewards - rewards.mean(axis=1, keepdims=True)) / (rewards.std(axis=1, keepdims=True) + 1e-6)


def batch(prompts: list[list[int]], groups, advantages: np.ndarray):
    """Right-padded [B, T] tokens and positions (-1: padding), with per-token masks (1 on answer
    tokens), the rollouts' logprobs and each token's advantage, all aligned to the token predicted."""
    seqs = [(p, c) for p, g in zip(prompts, groups) for c in g]
    length = max(len(p) + len(c.token_ids) for p, c in seqs)
    tokens = np.zeros((len(seqs), length), np.int32)
    positions = np.full((len(seqs), length), -1, np.int32)
    mask, old_lp, adv = (np.zeros((len(seqs), length - 1), np.float32) for _ in range(3))
    for i, ((p, c), a) in enumerate(zip(seqs, advantages.reshape(-1))):
        ids = list(p) + c.token_ids
        tokens[i, :len(ids)], positions[i, :len(ids)] = ids, np.arange(len(ids))
        span = slice(len(p) - 1, len(ids) - 1)  # logits at t predict token t+1
        mask[i, span], old_lp[i, span], adv[i, span] = 1.0, c.logprobs, a
    return tokens, positions, mask, old_lp, adv


def token_logprobs(graphdef, state, tokens, positions):
    """log p(token t+1 | tokens <= t) under `state`: [B, T-1]."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    logits = nnx.merge(graphdef, state)(tokens, positions)[:, :-1]
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, 1:, None], axis=-1)[..., 0]


def grpo_loss(state, graphdef, tokens, positions, mask, old_lp, adv, clip):
    import jax.numpy as jnp

    ratio = jnp.exp(token_logprobs(graphdef, state, tokens, positions) - old_lp)
    per_token = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    return -(per_token * mask).sum() / mask.sum()


def _define_flags() -> dict:
    """The script's flags; defined only when run as a script, so importing the module (its test) does
    not register --plot or --steps beside other modules' own."""
    return dict(
        steps=flags.DEFINE_integer("steps", 30, "GRPO steps (each: one rollout batch, --epochs optimizer steps).",
                                     lower_bound=1),
        prompts=flags.DEFINE_integer("prompts", 8, "Prompts per step.", lower_bound=1),
        group=flags.DEFINE_integer("group", 8, "Samples per prompt (the GRPO group).", lower_bound=2),
        max_tokens=flags.DEFINE_integer("max_tokens", 12, "Answer tokens at most.", lower_bound=1),
        lr=flags.DEFINE_float("lr", 1e-3, "Adam learning rate.", lower_bound=0.0),
        epochs=flags.DEFINE_integer("epochs", 2, "Optimizer steps per rollout batch.", lower_bound=1),
        clip=flags.DEFINE_float("clip", 0.2, "PPO ratio clip.", lower_bound=0.0),
        model=flags.DEFINE_string("model", "tiny-dense", "The policy: a config name (random weights) or a checkpoint."),
        devices=flags.DEFINE_integer("devices_per_replica", 4, "Devices of each of the two replicas.", lower_bound=1),
        seed=flags.DEFINE_integer("seed", 0, "Seed of the initial weights, the prompts and the sampling."),
        plot=flags.DEFINE_string("plot", None, "Write the reward curve here (PNG)."),
    )


def main(argv):
    del argv
    import jax
    import optax
    from absl import logging

    from talaria_jax.engine import EngineConfig, SamplingParams
    from talaria_jax.rollout import ReplicaSpec, RolloutService
    from talaria_jax.tokenizer import ByteTokenizer
    from talaria_jax.weights import load_model

    logging.set_verbosity(logging.WARNING)
    o = types.SimpleNamespace(**{name: flag.value for name, flag in F.items()})
    d = o.devices
    if 2 * d > jax.device_count():
        raise app.UsageError(f"--devices_per_replica={d}: two replicas need {2 * d} devices, this process has "
                             f"{jax.device_count()}")
    tok, rng = ByteTokenizer(), np.random.default_rng(o.seed)
    n_seqs = o.prompts * o.group
    cfg = EngineConfig(max_seqs=-(-n_seqs // 2), max_tokens_per_step=max(256, n_seqs), max_model_len=64,
                       prefix_cache=True, warmup=False)  # compile the step shapes as they come
    replicas = [ReplicaSpec(o.model, devices=tuple(range(i * d, (i + 1) * d)), seed=o.seed, engine=cfg,
                            compilation_cache=None).build() for i in range(2)]
    trainer = load_model(o.model, seed=o.seed).model  # the trainer's copy, on device 0
    graphdef, state = trainer.graphdef, trainer.state
    opt = optax.adam(o.lr)
    opt_state = opt.init(state)

    @functools.partial(jax.jit, static_argnums=(2,))
    def train_step(state, opt_state, graphdef, *batch_arrays):
        loss, grads = jax.value_and_grad(grpo_loss)(state, graphdef, *batch_arrays, o.clip)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    check = jax.jit(token_logprobs, static_argnums=0)
    params = SamplingParams(max_tokens=o.max_tokens, temperature=1.0)  # seeds: the service's, per call
    curve = []
    t0 = time.perf_counter()
    with RolloutService(replicas, seed=o.seed) as service:
        for step in range(o.steps):
            prompts = [tok.encode(q) for q in questions(rng, o.prompts)]
            groups = service.generate(prompts, params, n=o.group)
            rewards = np.array([[reward(c.token_ids, c.finish_reason) for c in g] for g in groups])
            arrays = batch(prompts, groups, group_advantages(rewards))
            tokens, positions, mask, old_lp, _ = arrays
            drift = float(np.abs((np.asarray(check(graphdef, state, tokens, positions)) - old_lp) * mask).max())
            for _ in range(o.epochs):
                state, opt_state, loss = train_step(state, opt_state, graphdef, *arrays)
            service.update_weights(state)
            curve.append(float(rewards.mean()))
            sample = tok.decode(groups[0][int(rewards[0].argmax())].token_ids)
            print(f"step {step + 1:3d}  reward {curve[-1]:.3f}  loss {float(loss):+.4f}  "
                  f"|service - trainer logprob| {drift:.1e}  best answer {sample!r}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        stats = service.stats()
    first, last = np.mean(curve[:3]), np.mean(curve[-3:])
    print(f"mean reward, first 3 steps {first:.3f} -> last 3 steps {last:.3f}; {stats['generated_tokens']} tokens "
          f"generated over 2 replicas in {time.perf_counter() - t0:.0f} s")
    if o.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(range(1, len(curve) + 1), curve, marker="o", ms=3)
        ax.set(xlabel="GRPO step", ylabel="mean reward (digit share)", ylim=(0, 1.02),
               title=f"grpo_toy: {o.model}, {o.prompts} prompts x {o.group} samples per step")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(o.plot, dpi=120)
        print(f"wrote {o.plot}")


F: dict = {}

if __name__ == "__main__":
    F.update(_define_flags())
    app.run(main)
