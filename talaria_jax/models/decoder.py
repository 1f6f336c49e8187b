"""One Flax NNX decoder family: Llama-3 / Qwen3 dense and Qwen3-MoE / GLM-4.5-style MoE.

Every parameter carries its logical axes (`axes=` metadata); `talaria_jax.sharding.rules` maps
those roles to mesh axes in one table. Attention goes through an `AttentionFn`, so the same module
runs full-sequence (the reference) and over the engine's paged KV pool.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from talaria_jax.models import layers, quant
from talaria_jax.models.attention import AttentionFn, LayerAttentionFn, full_sequence_attention
from talaria_jax.models.config import ModelConfig
from talaria_jax.models.quant import LinearAxes

INIT_STD = 0.02


def _param(rngs: nnx.Rngs, shape, axes, dtype, std=INIT_STD) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=axes)


def _ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), axes=axes)


def _zeros(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), axes=axes)


# The layouts of our linear weights: [in, out...], [in..., out] and experts' [expert, in, out].
_IN1, _IN2, _EXPERTS = LinearAxes(0, 1), LinearAxes(0, 2), LinearAxes(1, 1)


def linear_axes(cfg: ModelConfig, path: str) -> LinearAxes:
    """The layout of our linear weight `path` (a path `ModelConfig.linear_weights` lists)."""
    parts = path.split(".")
    if parts[-1] == "o_proj":
        return _IN2
    if parts[2] == "ffn" and parts[3] != "shared" and cfg.is_moe_layer(int(parts[1])):
        return _EXPERTS
    return _IN1


def _linear(cfg: ModelConfig, rngs: nnx.Rngs, path: str, shape, axes, lin: LinearAxes) -> tuple[nnx.Param, Any]:
    """A linear weight (random init) and its scale: (the weight in the compute dtype, None), or, where
    `cfg.quant` stores `path` quantized, (stored values, scales) in our layout (models/quant.py)."""
    q = cfg.quant
    if q is None or not q.quantizes(path):
        return _param(rngs, shape, axes, jnp.dtype(cfg.dtype)), None
    vshape, sshape = quant.value_shape(q, shape, lin, path), quant.scale_shape(q, shape, lin, path)
    if q.method == "fp8":  # values ~N(0, 1) times a scale of INIT_STD: the weights' usual spread
        value = jax.random.normal(rngs.params(), vshape, jnp.float32).astype(q.value_dtype)
        scale = jnp.full(sshape, INIT_STD, q.scale_dtype)
    else:  # random e2m1 pairs times 2^-6 (|w| <= 0.09)
        value = jax.random.randint(rngs.params(), vshape, 0, 256, jnp.int32).astype(q.value_dtype)
        scale = jnp.full(sshape, quant.MXFP4_SCALE_BIAS - 6, q.scale_dtype)
    return nnx.Param(value, axes=axes), nnx.Param(scale, axes=quant.scale_axes(q, shape, lin, axes))


def _weight(cfg: ModelConfig, value: nnx.Param, scale: nnx.Param | None, lin: LinearAxes) -> jax.Array:
    """A linear weight as the step computes with it: dequantized here, inside the jitted step, when stored
    quantized (so memory holds the checkpoint's bytes)."""
    if scale is None:
        return value[...]
    return layers.dequantize(value[...], scale[...], cfg.quant, lin, jnp.dtype(cfg.dtype))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        p = f"blocks.{layer}.attn"
        self.q_proj, self.q_proj_scale = _linear(cfg, rngs, f"{p}.q_proj", (e, h, d), ("embed", "heads", "head_dim"),
                                                 _IN1)
        self.k_proj, self.k_proj_scale = _linear(cfg, rngs, f"{p}.k_proj", (e, kv, d),
                                                 ("embed", "kv_heads", "head_dim"), _IN1)
        self.v_proj, self.v_proj_scale = _linear(cfg, rngs, f"{p}.v_proj", (e, kv, d),
                                                 ("embed", "kv_heads", "head_dim"), _IN1)
        self.o_proj, self.o_proj_scale = _linear(cfg, rngs, f"{p}.o_proj", (h, d, e), ("heads", "head_dim", "embed"),
                                                 _IN2)
        if cfg.attention_bias:
            self.q_bias = _zeros((h, d), ("heads", "head_dim"), dt)
            self.k_bias = _zeros((kv, d), ("kv_heads", "head_dim"), dt)
            self.v_bias = _zeros((kv, d), ("kv_heads", "head_dim"), dt)
        if cfg.attention_out_bias:
            self.o_bias = _zeros((e,), ("embed",), dt)
        if cfg.attention_sinks:
            self.sinks = _zeros((h,), ("heads",), dt)
        if cfg.qk_norm:
            self.q_norm = _ones((d,), ("head_dim",), dt)
            self.k_norm = _ones((d,), ("head_dim",), dt)

    def __call__(self, cfg: ModelConfig, x, positions, inv_freq, attn: LayerAttentionFn, kv_state):
        q = jnp.einsum("...e,ehd->...hd", x, _weight(cfg, self.q_proj, self.q_proj_scale, _IN1))
        k = jnp.einsum("...e,ehd->...hd", x, _weight(cfg, self.k_proj, self.k_proj_scale, _IN1))
        v = jnp.einsum("...e,ehd->...hd", x, _weight(cfg, self.v_proj, self.v_proj_scale, _IN1))
        if cfg.attention_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if cfg.qk_norm:
            q = layers.rms_norm(q, self.q_norm[...], cfg.norm_eps)
            k = layers.rms_norm(k, self.k_norm[...], cfg.norm_eps)
        scale = layers.rope_attention_factor(cfg)
        q = layers.apply_rope(q, positions, inv_freq, scale)
        k = layers.apply_rope(k, positions, inv_freq, scale)
        sinks = self.sinks[...] if cfg.attention_sinks else None
        out, kv_state = attn(q, k, v, kv_state, sinks=sinks)
        # [H, D, E] read as [H x D, E] (a bitcast): one plain matmul. As an einsum over (h, d) XLA:CPU
        # transposed the weight to [D, H, E] in every step (SmolLM2 decode 1.33x slower at batch 1).
        w = _weight(cfg, self.o_proj, self.o_proj_scale, _IN2)
        out = out.reshape(*out.shape[:-2], -1) @ w.reshape(-1, w.shape[-1])
        return (out + self.o_bias[...] if cfg.attention_out_bias else out), kv_state


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, ffn_size: int, rngs: nnx.Rngs, path: str, axis: str = "mlp"):
        e = cfg.hidden_size
        self.gate_proj, self.gate_proj_scale = _linear(cfg, rngs, f"{path}.gate_proj", (e, ffn_size), ("embed", axis),
                                                       _IN1)
        self.up_proj, self.up_proj_scale = _linear(cfg, rngs, f"{path}.up_proj", (e, ffn_size), ("embed", axis), _IN1)
        self.down_proj, self.down_proj_scale = _linear(cfg, rngs, f"{path}.down_proj", (ffn_size, e), (axis, "embed"),
                                                       _IN1)

    def __call__(self, cfg: ModelConfig, x):
        return layers.swiglu(x, _weight(cfg, self.gate_proj, self.gate_proj_scale, _IN1),
                             _weight(cfg, self.up_proj, self.up_proj_scale, _IN1),
                             _weight(cfg, self.down_proj, self.down_proj_scale, _IN1))


class MoE(nnx.Module):
    """Top-k routed experts (+ shared experts). Reference formulation: every expert runs on every
    token and the combine weights are zero off the top-k; exact, and shards experts over `ep`."""

    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        m = cfg.moe
        dt = jnp.dtype(cfg.dtype)
        e, x, f = cfg.hidden_size, m.num_experts, m.expert_ffn_size
        p = f"blocks.{layer}.ffn"
        self.router = _param(rngs, (e, x), ("embed", None), dt)
        if m.router_scoring == "sigmoid":
            self.score_bias = _zeros((x,), (None,), jnp.float32)
        if m.router_bias:
            self.router_bias = _zeros((x,), (None,), dt)
        self.gate_proj, self.gate_proj_scale = _linear(cfg, rngs, f"{p}.gate_proj", (x, e, f),
                                                       ("experts", "embed", "expert_mlp"), _EXPERTS)
        self.up_proj, self.up_proj_scale = _linear(cfg, rngs, f"{p}.up_proj", (x, e, f),
                                                   ("experts", "embed", "expert_mlp"), _EXPERTS)
        self.down_proj, self.down_proj_scale = _linear(cfg, rngs, f"{p}.down_proj", (x, f, e),
                                                       ("experts", "expert_mlp", "embed"), _EXPERTS)
        if m.expert_bias:
            self.gate_bias = _zeros((x, f), ("experts", "expert_mlp"), dt)
            self.up_bias = _zeros((x, f), ("experts", "expert_mlp"), dt)
            self.down_bias = _zeros((x, e), ("experts", "embed"), dt)
        if m.num_shared_experts:
            self.shared = MLP(cfg, m.num_shared_experts * f, rngs, f"{p}.shared")

    def routing(self, cfg: ModelConfig, x) -> jax.Array:
        """Dense combine weights [..., num_experts]: the top-k gate values, zero elsewhere."""
        m = cfg.moe
        # fp32 router, as HF computes it: in bf16 the top-k choice could differ.
        logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        if m.router_bias:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        if m.router_scoring == "sigmoid":
            scores = jax.nn.sigmoid(logits)
            _, idx = jax.lax.top_k(scores + self.score_bias[...], m.top_k)
            top = jnp.take_along_axis(scores, idx, axis=-1)
        elif m.router_scoring == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
            top, idx = jax.lax.top_k(scores, m.top_k)
        else:
            raise ValueError(f"{cfg.name}: moe.router_scoring {m.router_scoring!r} not in ['softmax', 'sigmoid']")
        if m.norm_topk_prob:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        top = top * m.routed_scaling_factor
        onehot = jax.nn.one_hot(idx, m.num_experts, dtype=jnp.float32)  # [..., k, X]
        return jnp.einsum("...k,...kx->...x", top, onehot).astype(x.dtype)

    def __call__(self, cfg: ModelConfig, x):
        m = cfg.moe
        combine = self.routing(cfg, x)
        g = jnp.einsum("...e,xef->...xf", x, _weight(cfg, self.gate_proj, self.gate_proj_scale, _EXPERTS))
        u = jnp.einsum("...e,xef->...xf", x, _weight(cfg, self.up_proj, self.up_proj_scale, _EXPERTS))
        if m.expert_bias:
            g, u = g + self.gate_bias[...], u + self.up_bias[...]
        h = layers.clamped_swiglu(g, u, m.swiglu_limit, m.swiglu_alpha) if m.swiglu_limit else jax.nn.silu(g) * u
        y = jnp.einsum("...xf,xfe,...x->...e", h, _weight(cfg, self.down_proj, self.down_proj_scale, _EXPERTS),
                       combine)
        if m.expert_bias:
            y = y + jnp.einsum("...x,xe->...e", combine, self.down_bias[...])
        if m.num_shared_experts:
            y = y + self.shared(cfg, x)
        return y


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.input_norm = _ones((cfg.hidden_size,), ("embed",), dt)
        self.attn = Attention(cfg, layer, rngs)
        self.post_attn_norm = _ones((cfg.hidden_size,), ("embed",), dt)
        self.is_moe = cfg.is_moe_layer(layer)
        self.ffn = MoE(cfg, layer, rngs) if self.is_moe else MLP(cfg, cfg.ffn_size, rngs, f"blocks.{layer}.ffn")

    def __call__(self, cfg, x, positions, inv_freq, attn: LayerAttentionFn, kv_state):
        h, kv_state = self.attn(cfg, layers.rms_norm(x, self.input_norm[...], cfg.norm_eps), positions, inv_freq,
                                attn, kv_state)
        x = x + h
        hn = layers.rms_norm(x, self.post_attn_norm[...], cfg.norm_eps)
        x = x + self.ffn(cfg, hn)
        return x, kv_state


def run_blocks(cfg: ModelConfig, blocks: list[Block], attns: list[LayerAttentionFn], x: jax.Array,
               positions: jax.Array, kv_state: Any):
    """`blocks` in order over x, each with its AttentionFn (`attns`, each bound to its layer)."""
    inv_freq = jnp.asarray(layers.rope_inv_freq(cfg))
    for block, attn in zip(blocks, attns):
        x, kv_state = block(cfg, x, positions, inv_freq, attn, kv_state)
    return x, kv_state


class Decoder(nnx.Module):
    """Decoder-only LM. `cfg` is static; parameters are the module's nnx.Params."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        if cfg.unsupported:
            # Shapes and byte counts of such configs are still valid; running them would be silently wrong.
            raise NotImplementedError(f"{cfg.name}: this decoder does not implement {list(cfg.unsupported)}")
        dt = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt)
        self.blocks = nnx.List([Block(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.final_norm = _ones((cfg.hidden_size,), ("embed",), dt)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt)

    def hidden(self, tokens: jax.Array, positions: jax.Array, attn: AttentionFn, kv_state: Any = None):
        """Final-norm hidden states [..., T, E] and the threaded kv_state."""
        x = self.embed_tokens(tokens)
        attns = [functools.partial(attn, i) for i in range(len(self.blocks))]
        x, kv_state = run_blocks(self.cfg, list(self.blocks), attns, x, positions, kv_state)
        return self.norm(x), kv_state

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The first layer's input [..., T, E]."""
        return jnp.take(self.embed[...], tokens, axis=0)

    def norm(self, x: jax.Array) -> jax.Array:
        """The final norm of the last layer's output."""
        return layers.rms_norm(x, self.final_norm[...], self.cfg.norm_eps)

    def logits(self, h: jax.Array) -> jax.Array:
        w = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return jnp.einsum("...e,ev->...v", h, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Full-sequence forward of a right-padded batch [B, T]: fp32 logits [B, T, V] at every position.

        positions default to 0..T-1; pass -1 at padding to mask those keys.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        h, _ = self.hidden(tokens, positions, full_sequence_attention(self.cfg.sliding_windows, positions))
        return self.logits(h)
