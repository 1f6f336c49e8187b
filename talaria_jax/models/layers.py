"""Small pure functions shared by the decoders: RMSNorm, RoPE (with Llama-3 scaling), SwiGLU."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from talaria_jax.models.config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32 and cast back, as HF Llama/Qwen3 do."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x32.astype(dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies for the rotated part of each head, with Llama-3 scaling (as HF's rope_scaling
    or as GGUF's per-frequency factors) if configured."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if cfg.rope_freq_factors:  # ggml divides each frequency by its factor (GGUF's rope_freqs)
        return (inv / np.asarray(cfg.rope_freq_factors, np.float64)).astype(np.float32)
    sc = cfg.rope_scaling
    if sc is None:
        return inv.astype(np.float32)
    if sc.rope_type != "llama3":
        raise NotImplementedError(f"{cfg.name}: rope_scaling.rope_type {sc.rope_type!r} is not implemented (llama3 is)")
    old = sc.original_max_position_embeddings
    low_wavelen = old / sc.low_freq_factor
    high_wavelen = old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates the first 2*len(inv_freq) dims of each head (HF's rotate_half layout).

    x: [..., T, heads, head_dim]; positions: [..., T].
    """
    rot = 2 * inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, rot/2]
    cos = jnp.cos(freqs)[..., None, :].astype(x.dtype)
    sin = jnp.sin(freqs)[..., None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down
