"""Ragged attention over a paged KV pool, plain jnp (the reference every kernel is tested against).

Queries are flat: token t sits at position pos[t] of its sequence and attends to that sequence's
keys at positions <= pos[t] (within the sliding window, if any). The tokens are grouped in query
tiles: tile n holds up to `tile` consecutive tokens of one sequence (row tile_seq[n] of the page
tables), so each page block is gathered once per tile rather than once per token: a prefill chunk
of 512 tokens in tiles of 16 reads its context 32 times, not 512. Decode steps use tiles of one.
Keys are read page block by page block with an online softmax, so memory stays O(tiles x block)
whatever the context length, and the loop runs only as many blocks as the longest sequence needs.
Where each token sits (pages, positions, tiles, draft trees) travels as one `AttentionMetadata`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity": a fully masked block then contributes exp(0) that a later max wipes out


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's T tokens sit in the paged KV, for every attention layer of the step: one record
    (as vLLM's `CommonAttentionMetadata`), a pytree of int32 arrays.

    tree: draft trees (speculative decoding), (base [T], anc [T]): a token sees the keys below position
    base[t] as usual, and of the keys from base[t] on only those whose bit (key - base) is set in
    anc[t] (its ancestors and itself in its draft tree; a tree's nodes sit at positions base, base + 1,
    ... in depth-first order); base past every position for tokens outside a tree. Not with a sliding
    window (pos is then the slot order, not the depth)."""
    page_tables: jax.Array  # [B, MP], each sequence's pages (MP a multiple of pages_per_block)
    pos: jax.Array          # [T], each token's position in its sequence's pages (it sees keys up to it)
    tile_tok: jax.Array     # [NT, Q], the token in each query-tile slot (T for an empty slot)
    tile_seq: jax.Array     # [NT], each tile's sequence (its page-table row)
    tok_slot: jax.Array     # [T], each token's flat tile slot (NT x Q for a padding token: output zero)
    num_blocks: jax.Array   # scalar, blocks of pages the longest sequence needs
    tree: tuple[jax.Array, jax.Array] | None = None


jax.tree_util.register_dataclass(AttentionMetadata,
                                 data_fields=[f.name for f in dataclasses.fields(AttentionMetadata)], meta_fields=[])


def ragged_paged_attention(q: jax.Array, read: Callable, kv_heads: int, page_size: int, meta: AttentionMetadata,
                           pages_per_block: int, window: int = 0, sinks: jax.Array | None = None) -> jax.Array:
    """q: [T, H, D]; read(pages [NT, n]) -> K, V [NT, n, page_size, kv_heads, D] of those pages (one layer's,
    e.g. `talaria_jax.kvcache.pool.read_kv`); `meta`: where the tokens sit, its `num_blocks` blocks of
    `pages_per_block` pages visited. sinks: [H] logits in every query's softmax with no value (gpt-oss),
    or None: the online softmax starts from them (running max = sink, sum = 1) instead of from nothing.
    Returns [T, H, D]."""
    page_tables, pos, tile_tok, tile_seq, tok_slot, num_blocks, tree = (
        meta.page_tables, meta.pos, meta.tile_tok, meta.tile_seq, meta.tok_slot, meta.num_blocks, meta.tree)
    t, h, d = q.shape
    nt, qt = tile_tok.shape
    ps, kvh = page_size, kv_heads
    g = h // kvh
    blk = pages_per_block * ps
    q_pad = jnp.concatenate([q, jnp.zeros((1, h, d), q.dtype)])
    pos_pad = jnp.concatenate([pos, jnp.full((1,), -1, pos.dtype)])  # an empty slot sees no key
    # [NT, KV, Q*G, D]: a tile's queries of one kv head form one matrix against the block's keys
    qg = q_pad[tile_tok].reshape(nt, qt, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(nt, kvh, qt * g, d)
    qg = qg.astype(jnp.float32) * (d ** -0.5)
    qpos = pos_pad[tile_tok]  # [NT, Q]
    if tree is not None:
        base, anc = (jnp.concatenate([a, jnp.zeros((1,), a.dtype)])[tile_tok] for a in tree)
    tile_pages = page_tables[tile_seq]  # [NT, MP]

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tile_pages, i * pages_per_block, pages_per_block, axis=1)
        kb, vb = read(pages)
        kb = kb.reshape(nt, blk, kvh, d).astype(jnp.float32)
        vb = vb.reshape(nt, blk, kvh, d).astype(jnp.float32)
        key_pos = i * blk + jnp.arange(blk)
        mask = key_pos[None, None, :] <= qpos[:, :, None]  # [NT, Q, blk]
        if window:
            mask &= qpos[:, :, None] - key_pos[None, None, :] < window
        if tree is not None:
            off = key_pos[None, None, :] - base[:, :, None]
            bit = jnp.right_shift(anc[:, :, None], jnp.clip(off, 0, 31)) & 1
            mask &= (off < 0) | (bit == 1)
        s = jnp.einsum("nkmd,nskd->nkms", qg, kb).reshape(nt, kvh, qt, g, blk)
        s = jnp.where(mask[:, None, :, None, :], s, _NEG).reshape(nt, kvh, qt * g, blk)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("nkms,nskd->nkmd", p, vb)
        return m_new, l, acc

    if sinks is None:
        m0, l0 = jnp.full((nt, kvh, qt * g), _NEG, jnp.float32), jnp.zeros((nt, kvh, qt * g), jnp.float32)
    else:  # row (k, q * g + j) of a tile is query q's head k * g + j
        m0 = jnp.broadcast_to(jnp.tile(sinks.astype(jnp.float32).reshape(kvh, g), (1, qt)), (nt, kvh, qt * g))
        l0 = jnp.ones((nt, kvh, qt * g), jnp.float32)
    init = (m0, l0, jnp.zeros((nt, kvh, qt * g, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [NT, KV, Q*G, D]
    out = out.reshape(nt, kvh, qt, g, d).transpose(0, 2, 1, 3, 4).reshape(nt * qt, h, d)
    out = jnp.concatenate([out, jnp.zeros((1, h, d), out.dtype)])[tok_slot]
    return out.astype(q.dtype)
