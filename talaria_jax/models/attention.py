"""Reference attention over whole sequences (the plain-jnp path every faster path is tested against).

Decoders call attention through an `AttentionFn(layer, q, k, v, kv_state, sinks=None) -> (out, kv_state)`,
so the same model runs full-sequence (this file) and over a paged KV pool (the engine) unchanged.
`sinks` ([heads], gpt-oss) are per-head logits that join each query's softmax with no value: they
take a share of the probability, so the keys' weights sum to less than one.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, kv_state: Any,
                 sinks: jax.Array | None = None) -> tuple[jax.Array, Any]:
        ...


class LayerAttentionFn(Protocol):
    """An AttentionFn bound to one layer (what each decoder block calls)."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_state: Any,
                 sinks: jax.Array | None = None) -> tuple[jax.Array, Any]:
        ...


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                     window: int = 0, sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention with a causal (and optional sliding-window) mask built from positions.

    q: [B, T, H, D]; k, v: [B, S, KV, D]; q_pos: [B, T]; k_pos: [B, S] with -1 for padding keys.
    sinks: [H] logits that join each row's softmax with no value (None: none). Returns [B, T, H, D].
    Softmax in fp32.
    """
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)
    if window:
        mask &= q_pos[:, :, None] - k_pos[:, None, :] < window
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kvh, h // kvh, 1, 1), (b, kvh, h // kvh, t, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # fully masked rows (padding queries)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, d)


def full_sequence_attention(windows: tuple[int, ...], positions: jax.Array) -> AttentionFn:
    """An AttentionFn for a padded batch [B, T] with no cache: positions -1 mark padding."""

    def attn(layer, q, k, v, kv_state, sinks=None):
        window = windows[layer] if windows else 0
        return causal_attention(q, k, v, positions, positions, window, sinks), kv_state

    return attn
