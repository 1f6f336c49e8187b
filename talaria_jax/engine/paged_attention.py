"""Ragged attention over a paged KV pool, plain jnp (the reference every kernel is tested against).

Queries are flat: token t belongs to sequence seq[t] at position pos[t], and attends to that
sequence's keys at positions <= pos[t] (within the sliding window, if any). Keys are read page
block by page block with an online softmax, so memory stays O(tokens x block) whatever the
context length, and the loop runs only as many blocks as the longest sequence in the step needs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity": a fully masked block then contributes exp(0) that a later max wipes out


def write_kv(pool_k: jax.Array, pool_v: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array):
    """Scatters new K/V [T, KV, D] into flat slots; slots >= num_slots (padding) are dropped, never clamped."""
    p, ps, kvh, d = pool_k.shape
    flat_k = pool_k.reshape(p * ps, kvh, d).at[slots].set(k.astype(pool_k.dtype), mode="drop")
    flat_v = pool_v.reshape(p * ps, kvh, d).at[slots].set(v.astype(pool_v.dtype), mode="drop")
    return flat_k.reshape(p, ps, kvh, d), flat_v.reshape(p, ps, kvh, d)


def ragged_paged_attention(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, page_tables: jax.Array,
                           seq: jax.Array, pos: jax.Array, num_blocks: jax.Array, pages_per_block: int,
                           window: int = 0) -> jax.Array:
    """q: [T, H, D]; pools: [P, page_size, KV, D]; page_tables: [B, MP] (MP a multiple of pages_per_block);
    seq, pos: [T]; num_blocks: scalar, blocks of pages to visit. Returns [T, H, D]."""
    t, h, d = q.shape
    _, ps, kvh, _ = pool_k.shape
    g = h // kvh
    blk = pages_per_block * ps
    qg = q.reshape(t, kvh, g, d).astype(jnp.float32) * (d ** -0.5)
    tok_pages = page_tables[seq]  # [T, MP]

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tok_pages, i * pages_per_block, pages_per_block, axis=1)
        kb = pool_k[pages].reshape(t, blk, kvh, d).astype(jnp.float32)
        vb = pool_v[pages].reshape(t, blk, kvh, d).astype(jnp.float32)
        key_pos = i * blk + jnp.arange(blk)
        mask = key_pos[None, :] <= pos[:, None]
        if window:
            mask &= pos[:, None] - key_pos[None, :] < window
        s = jnp.einsum("tkgd,tskd->tkgs", qg, kb)
        s = jnp.where(mask[:, None, None, :], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("tkgs,tskd->tkgd", p, vb)
        return m_new, l, acc

    init = (jnp.full((t, kvh, g), _NEG, jnp.float32), jnp.zeros((t, kvh, g), jnp.float32),
            jnp.zeros((t, kvh, g, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(t, h, d).astype(q.dtype)
