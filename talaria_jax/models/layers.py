"""Small pure functions shared by the decoders: RMSNorm, RoPE (with Llama-3 or YaRN scaling), SwiGLU, and
the dequantization of stored weights (models/quant.py)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from talaria_jax.models import quant
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
    if sc.rope_type == "yarn":
        return _yarn_inv_freq(inv, dim, cfg.rope_theta, sc)
    if sc.rope_type != "llama3":
        raise NotImplementedError(f"{cfg.name}: rope_scaling.rope_type {sc.rope_type!r} is not implemented "
                                  "(llama3 and yarn are)")
    old = sc.original_max_position_embeddings
    low_wavelen = old / sc.low_freq_factor
    high_wavelen = old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, dim: int, base: float, sc) -> np.ndarray:
    """YaRN (arXiv:2309.00071) as HF's `_compute_yarn_parameters`: frequencies below the correction
    range interpolated by `factor`, above it kept, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(sc.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.astype(np.float64)
    return (inv / sc.factor * (1 - extrapolation) + inv * extrapolation).astype(np.float32)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN scales cos and sin by (0.1 ln(factor) + 1); 1 for every other RoPE."""
    sc = cfg.rope_scaling
    if sc is None or sc.rope_type != "yarn" or sc.factor <= 1:
        return 1.0
    return 0.1 * math.log(sc.factor) + 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotates the first 2*len(inv_freq) dims of each head (HF's rotate_half layout); cos and sin are
    multiplied by `scale` (YaRN's attention factor).

    x: [..., T, heads, head_dim]; positions: [..., T].
    """
    rot = 2 * inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, rot/2]
    cos = (jnp.cos(freqs) * scale)[..., None, :].astype(x.dtype)
    sin = (jnp.sin(freqs) * scale)[..., None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's gated activation: the gate clamped above at `limit`, the up projection to +-`limit`,
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1)


def dequantize(value: jax.Array, scale: jax.Array, q: quant.QuantConfig, axes: quant.LinearAxes, dtype) -> jax.Array:
    """A quantized weight in `dtype` (inside the jitted step) from its stored values and scales in our
    layout: fp8 values times their block's scale; mxfp4 nibbles (the even element low) through the
    e2m1 table, times 2^(exponent - 127). Each scale repeats over its block's elements along each axis
    (`quant.blocks`; a last block may be partial). The step holds the whole matrix in `dtype` for its
    matmul (XLA:CPU materializes it), so only the resident copy is the checkpoint's size."""
    p = quant.packed_axis(q, axes)
    if p is None:
        w = value.astype(jnp.float32)
        s = scale.astype(jnp.float32)
    else:
        lut = jnp.asarray(quant.FP4_VALUES)
        lo, hi = lut[(value & 0x0F).astype(jnp.int32)], lut[(value >> 4).astype(jnp.int32)]
        w = jnp.stack([lo, hi], axis=p + 1).reshape(value.shape[:p] + (2 * value.shape[p],) + value.shape[p + 1:])
        s = jnp.exp2(scale.astype(jnp.float32) - quant.MXFP4_SCALE_BIAS)
    for axis, (d, b) in enumerate(zip(w.shape, quant.blocks(q, w.shape, axes))):
        if 1 < b < d:  # several elements share a scale along this axis; the last block may be partial
            s = jax.lax.slice_in_dim(jnp.repeat(s, b, axis=axis), 0, d, axis=axis)
    return (w * s).astype(dtype)
