"""A Tunix rollout engine backed by the rollout service: WAR inside Tunix's RL learners.

Tunix (`google-tunix`, the `[tunix]` extra) takes any `BaseRollout` subclass as its rollout engine;
Tunix constructs it with the rollout actor, the tokenizer, the rollout mesh and the rollout config:

    import functools
    from tunix.rl import rl_cluster as rl_cluster_lib
    from talaria_jax.rollout.tunix_rollout import TalariaRollout

    cluster_config = rl_cluster_lib.ClusterConfig(
        rollout_engine=functools.partial(TalariaRollout, replicas=2),   # instead of "vanilla"
        role_to_mesh=..., training_config=..., rollout_config=...)

Generation goes through a `RolloutService` over `replicas` engines, each on its share of the
rollout mesh's devices: cache-aware placement (a prompt's repeats, GRPO's group, land where its
prefix is cached), suffix-tree speculation when `speculation` is set (drafts at low load, none while
requests wait for a slot), and `update_params` resharding the trainer's weights onto every replica.

Tunix's model families run as our decoder with their parameters mapped by name (`config_from_tunix`,
`params_from_tunix`): Llama-3 (`tunix.models.llama3`) and dense Qwen3 (`tunix.models.qwen3`). Their
forward is what is matched, not their checkpoints' published configs: in google-tunix 0.1.7 both
rotate with RoPE theta 1e6 whatever the config's `rope_theta` says (their attention calls
`apply_rope` without it), so the mapped config does the same; tests/rollout/test_tunix.py checks greedy
tokens and per-token logprobs against Tunix's own sampler and `compute_per_token_logps`.

What `generate` returns follows Tunix's vanilla sampler: prompts tokenized as its `Sampler.tokenize`
does (BOS + ids), left-padded to `max_prompt_length` (or the next power of 2 of the longest prompt
when longer), completions without their end token, logprobs the raw log-softmax of each sampled token
(what `get_per_token_logps` recomputes). `logits` is an empty list, as the vanilla engine returns
when not asked for them (Tunix's learners do not read them). One difference: Tunix's sampler masks
every pad id out of attention, a sampled one too, so after a completion samples the pad id the two
continue differently (trained models do not sample it; Tunix's loss masks it out in either case).
"""
from __future__ import annotations

import hashlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import tokenizer_adapter
from tunix.rl.rollout import base_rollout

from talaria_jax.engine.engine import Engine, EngineConfig
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.engine.spec import SpecConfig
from talaria_jax.models.config import ModelConfig
from talaria_jax.models.model import forward, init_model, with_params
from talaria_jax.rollout.replica import Replica
from talaria_jax.rollout.service import RolloutService
from talaria_jax.sharding import make_mesh

__all__ = ["TalariaRollout", "config_from_tunix", "params_from_tunix"]

# RoPE theta of google-tunix 0.1.7's Llama3 and Qwen3 attention (`apply_rope`'s default; the config's
# rope_theta is not passed to it).
TUNIX_ROPE_THETA = 1_000_000.0

# Tunix parameter path -> ours ({i}: the layer).
_NAMES = [
    (r"embedder\.input_embedding", "embed"),
    (r"final_norm\.w", "final_norm"),
    (r"lm_head\.w", "lm_head"),
    (r"layers\.(\d+)\.input_layernorm\.w", "blocks.{}.input_norm"),
    (r"layers\.(\d+)\.post_attention_layernorm\.w", "blocks.{}.post_attn_norm"),
    (r"layers\.(\d+)\.attn\.([qkvo])_proj\.w", "blocks.{}.attn.{}_proj"),
    (r"layers\.(\d+)\.attn\.([qk])_norm\.w", "blocks.{}.attn.{}_norm"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.kernel", "blocks.{}.ffn.{}_proj"),
]


def config_from_tunix(model: nnx.Module, name: str = "tunix") -> ModelConfig:
    """Our decoder config for a Tunix Llama3 or dense Qwen3 module (its forward, see the module
    docstring); the compute dtype is its parameters'.

    Raises:
        ValueError: a family or feature not mapped.
    """
    family = type(model).__name__
    if family not in ("Llama3", "Qwen3"):
        raise ValueError(f"tunix model {family}: mapped families are Llama3 and Qwen3 (dense)")
    c = model.config
    if family == "Llama3":
        tied, qk_norm = bool(c.weight_tying), False
    elif family == "Qwen3":
        if c.num_experts:
            raise ValueError(f"tunix Qwen3 with {c.num_experts} experts: only dense Qwen3 is mapped")
        tied, qk_norm = bool(c.use_tied_embedding), True
    dtype = str(jnp.dtype(model.embedder.input_embedding[...].dtype))
    return ModelConfig(name=f"{name}-{family.lower()}", vocab_size=c.vocab_size, hidden_size=c.embed_dim,
                       num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                       head_dim=c.head_dim, ffn_size=c.hidden_dim, rope_theta=TUNIX_ROPE_THETA,
                       norm_eps=float(c.norm_eps), qk_norm=qk_norm, tie_embeddings=tied, dtype=dtype,
                       weight_dtype=dtype, kv_dtype=dtype)


def _flat(params: Any) -> dict[str, Any]:
    """{'layers.0.attn.q_proj.w': array} from an nnx.State, a module or a nested dict."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        return {".".join(map(str, p)): (v[...] if isinstance(v, nnx.Variable) else v)
                for p, v in nnx.to_flat_state(params)}
    return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): v
            for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def params_from_tunix(params: Any) -> dict[str, Any]:
    """Tunix parameters (an nnx.State, the module, or a nested dict of arrays, whole or in part) as
    our flat names, same shapes: both keep q/k/v as [embed, heads, head_dim] and o as [heads,
    head_dim, embed].

    Raises:
        ValueError: a parameter with no counterpart here (a LoRA adapter, say), named.
    """
    out = {}
    for name, value in _flat(params).items():
        for pattern, ours in _NAMES:
            m = re.fullmatch(pattern, name)
            if m:
                out[ours.format(*m.groups())] = value
                break
        else:
            raise ValueError(f"tunix parameter {name!r} has no counterpart in the talaria decoder "
                             f"(LoRA adapters are not mapped: merge them into the base weights first)")
    return out


def _seed(seed: Any) -> int | None:
    """An int seed from RolloutConfig.seed (None, an int, or a JAX PRNG key)."""
    if seed is None or isinstance(seed, (int, np.integer)):
        return None if seed is None else int(seed)
    data = np.asarray(jax.random.key_data(seed) if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) else seed)
    return int.from_bytes(hashlib.blake2b(data.tobytes(), digest_size=8).digest(), "little") >> 2


class TalariaRollout(base_rollout.BaseRollout):
    """Tunix's rollout interface over a `RolloutService` (see the module docstring).

    `rollout_actor`, `tokenizer`, `mesh`, `rollout_config`: what Tunix's RLCluster passes. `replicas`:
    engines, each on len(mesh devices) / replicas of the mesh's devices (all on one device when there
    are fewer devices than replicas). `placement`: a `placement.PLACEMENTS` name. `speculation`:
    suffix-tree speculation (None: off). `max_seqs`: each engine's batch. `engine`: an EngineConfig
    for the replicas instead (its max_model_len at least max_prompt_length + max_tokens_to_generate).
    """

    def __init__(self, rollout_actor: nnx.Module, tokenizer: Any, mesh: jax.sharding.Mesh | None = None,
                 rollout_config: base_rollout.RolloutConfig | None = None, *, replicas: int = 2,
                 placement: str = "cache_aware", speculation: SpecConfig | None = None, max_seqs: int = 16,
                 engine: EngineConfig | None = None, seed: int = 0):
        """`replicas` engines on equal shares of `mesh`'s devices (one device when None), each serving
        `rollout_actor`'s parameters; `engine` overrides the engine configuration built from
        `rollout_config`.

        Raises:
            ValueError: `replicas` < 1, or a model or parameter with no counterpart here
                (`config_from_tunix`, `params_from_tunix`).
        """
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        rollout_config = rollout_config or base_rollout.RolloutConfig()
        graphdef, state = nnx.split(rollout_actor)
        self._shape = nnx.merge(graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
        self._tok = (tokenizer if isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter)
                     else tokenizer_adapter.TokenizerAdapter(tokenizer))
        self.cfg = config_from_tunix(rollout_actor)
        if engine is None:
            engine = EngineConfig(max_seqs=max_seqs, max_model_len=rollout_config.kv_cache_size, prefix_cache=True,
                                  warmup=False, speculation=speculation)
        devices = list(np.asarray(mesh.devices).flat) if mesh is not None else jax.devices()[:1]
        per = max(1, len(devices) // replicas)
        meshes = [make_mesh(devices[(i * per) % len(devices):(i * per) % len(devices) + per]) for i in range(replicas)]
        params = params_from_tunix(rollout_actor)
        self._engines = [Engine(with_params(init_model(self.cfg, m), params, tag="tunix-0"), engine) for m in meshes]
        self.service = RolloutService([Replica(e) for e in self._engines], placement, seed=seed)
        self.mesh = mesh

    @property
    def weight_version(self) -> int:
        """How many times `update_params` has changed the weights (the service's `weight_version`)."""
        return self.service.weight_version

    # ---- BaseRollout ---------------------------------------------------------------------------------
    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs) -> base_rollout.RolloutOutput:
        """One completion per prompt (GRPO passes each prompt `num_generations` times: placement
        keeps a group's repeats on the replica that holds its prefix). A str is one prompt, as Tunix's
        sampler takes it (its agentic learner passes one conversation so).

        Raises:
            RuntimeError: a rollout request failed (its id and error).
        """
        ids = [self._tokenize(p) for p in ([prompts] if isinstance(prompts, str) else prompts)]
        width = max(len(x) for x in ids)
        if rollout_config.max_prompt_length is not None and rollout_config.max_prompt_length >= width:
            width = rollout_config.max_prompt_length
        else:
            width = 1 << (width - 1).bit_length()  # as Tunix's sampler: the next power of 2
        stops = tuple(int(t) for t in (rollout_config.eos_tokens or [self.eos_id()]))
        params = SamplingParams(max_tokens=int(rollout_config.max_tokens_to_generate),
                                temperature=float(rollout_config.temperature or 0.0),
                                top_p=float(rollout_config.top_p if rollout_config.top_p is not None else 1.0),
                                top_k=int(rollout_config.top_k or 0), seed=_seed(rollout_config.seed),
                                stop_token_ids=stops)
        outs = [group[0] for group in self.service.generate(ids, params)]
        failed = [c for c in outs if c.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"rollout request {failed[0].request_id} failed: {failed[0].error}")
        tokens, logprobs = [], []
        for c in outs:
            n = len(c.token_ids) - (c.finish_reason == "stop" and bool(c.token_ids) and c.token_ids[-1] in stops)
            tokens.append(np.asarray(c.token_ids[:n], np.int32))
            logprobs.append(list(c.logprobs[:n]))
        padded = np.full((len(ids), width), self.pad_id(), np.int32)
        for i, x in enumerate(ids):
            padded[i, width - len(x):] = x
        return base_rollout.RolloutOutput(text=[self._tok.decode(t.tolist()) for t in tokens], logits=[],
                                          tokens=tokens, left_padded_prompt_tokens=padded, logprobs=logprobs)

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """Log-probabilities [B, C] of `completion_tokens` (right-padded) after `prompt_tokens`
        (left-padded), computed by this engine's model (replica 0's weights) at temperature 1; pad
        positions are masked out of attention, as Tunix's `compute_per_token_logps` does."""
        prompt, completion = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        tokens = np.concatenate([prompt, completion], axis=1).astype(np.int32)
        mask = tokens != self.pad_id()
        positions = np.where(mask, np.cumsum(mask, axis=1) - 1, -1).astype(np.int32)
        logits = forward(self._engines[0].model, tokens, positions)[:, -completion.shape[1] - 1:-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, jnp.asarray(completion, jnp.int32)[..., None], axis=-1)[..., 0]

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Every replica serves `params` (Tunix's, whole or a part: the rest keep their values) from
        now on; nothing computed with the old weights (KV, prefix cache, drafts) is reused."""
        # a name the decoder lacks (lm_head of a tied model, say) is refused by models.with_params
        self.service.update_weights({**self._engines[0].model.param_arrays(), **params_from_tunix(params)})

    def pad_id(self) -> int:
        return self._tok.pad_id()

    def eos_id(self) -> int:
        return self._tok.eos_id()

    def model(self) -> nnx.Module:
        """The actor's module with shapes in place of weights: the weights live in the replicas' engines,
        so Tunix's learner sees a model that shares none of the trainer's and syncs them after every
        step (`update_params`). Tunix's `offload_to_cpu` has nothing to move here."""
        return self._shape

    def close(self) -> None:
        self.service.close()

    # ---- helpers -------------------------------------------------------------------------------------
    def _tokenize(self, prompt: str) -> list[int]:
        """As Tunix's Sampler.tokenize: BOS (when the tokenizer has one) + the ids, one leading BOS kept."""
        bos = [self._tok.bos_id()] if self._tok.bos_id() else []
        return [int(t) for t in self._tok.dedup_bos_ids(bos + list(self._tok.encode(prompt)))]
