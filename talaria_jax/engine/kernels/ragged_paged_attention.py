"""Ragged paged attention as one Pallas kernel (Triton on GPU, the Pallas interpreter elsewhere).

The same attention as `talaria_jax.engine.paged_attention.ragged_paged_attention` (the spec; see it
for the inputs), but the K/V pages are read straight from the KV arena instead of gathered into a
[tiles, block, kv_heads, head_dim] temporary in HBM, as the reference's `read` does once per block.

Layout. Inside a shard_map over the arena (as kvcache/pool.py's readers), each device sees its rows
as one flat [pages x rows, local kv heads, head_dim] array (a reshape: no byte moves); page p's
layer-l K sits at rows p x rows + 2l x page_size onwards, its V page_size rows further on. The grid
is (query tiles, head groups): program (n, j) holds tile n's queries of group j, Q tokens x G' heads
that share one kv head, as one [M, head_dim] matrix (row = slot x G' + head, padded with empty rows
to M, a power of two >= 16, as Triton's dots want), and walks that tile's pages one at a time: the
page index comes from the tile's page-table row, K and V are two [page_size, head_dim] loads of the
arena, and an online softmax (running max, sum, fp32 accumulator) folds them in, so each page is
read once per tile and head group whatever the context length. Scores and the accumulator are fp32
whatever the KV dtype: 16-bit K/V meet queries cast to their dtype in dots that accumulate in fp32
(fp32 K/V in full-precision fp32 dots; fp8 K/V are widened to bf16 first).

Only the pages a tile can see are read: up to the page of its last position (a decode token of a
short sequence in a batch with long ones stops early, where the reference runs every tile over
`num_blocks` blocks), and with a sliding window from the page of its first position's window start.

Head groups. G' = gcd(local q heads, q heads per kv head), so a group never straddles kv heads: where
the pool's kv heads are split over tp (the usual case) a device's q heads are whole groups of its
kv heads and G' is the GQA ratio; where kv heads are replicated (kv_heads does not divide tp, see
`view_sharding`) a device's q heads are a slice of the global heads that may cover part of one kv
head, or parts of two; each group's kv head is then computed from the global q head ids it holds.

Not done: splitting a sequence's pages over programs (flash-decoding), so a decode step of few
sequences runs few programs (tiles x kv heads), each walking its whole context; nor loading a
block of pages at once (a program reads one page per loop step).

Draft-tree masks (`tree`), sliding windows and attention sinks (gpt-oss: each row's online softmax
starts from its head's sink logit) are supported as in the reference. Triton needs
power-of-two block shapes of at least 16 for its dots: on GPU, page_size and head_dim must be
powers of two >= 16 (`check_shapes` says which field is wrong); the interpreter takes any.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import Mesh, PartitionSpec as P

from talaria_jax.engine.paged_attention import AttentionMetadata
from talaria_jax.kvcache.pool import PoolSpec, on_each_device, local_view, arena_sharding, view_sharding
from talaria_jax.sharding import mesh_platform, spec_for

_NEG = -1e30  # as the reference: a fully masked page adds exp(0) terms that a later real max wipes out
_FAR = 2**30  # "no position": the first-position reduction's identity


def on_gpu(mesh: Mesh) -> bool:
    """Whether `mesh`'s devices are GPUs (the kernel compiles with Triton there; elsewhere it is interpreted)."""
    return mesh_platform(mesh) == "gpu"


def _untileable(page_size: int, head_dim: int) -> list[tuple[str, int]]:
    """The (field, value) pairs Triton cannot tile: a K/V load is [page_size, head_dim], and Triton's
    blocks are powers of two, its dots at least 16 wide."""
    return [(f, n) for f, n in (("page_size", page_size), ("head_dim", head_dim)) if n < 16 or n & (n - 1)]


def triton_fits(page_size: int, head_dim: int) -> bool:
    """Whether Triton takes the pool's page_size and head_dim (`check_shapes` says which does not)."""
    return not _untileable(page_size, head_dim)


def check_shapes(page_size: int, head_dim: int, gpu: bool = True) -> None:
    """ValueError naming the field when Triton cannot tile it (on GPU). The interpreter takes any shape."""
    for field, n in _untileable(page_size, head_dim) if gpu else ():
        raise ValueError(f"the Pallas attention kernel needs {field} to be a power of two >= 16 on GPU, got {n}")


def _pow2_rows(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _kernel(nb_ref, pages_ref, kvg_ref, kv_ref, q_ref, qpos_ref, *rest, page_size: int, rows: int, layer: int,
            pages_per_block: int, window: int, tree: bool, sinks: bool):
    """Program (tile n, head group j): out [M, D] of the group's M query rows over the tile's pages."""
    rest = list(rest)
    base_ref, anc_ref = (rest.pop(0), rest.pop(0)) if tree else (None, None)
    sink_ref = rest.pop(0) if sinks else None
    (o_ref,) = rest
    n, j = pl.program_id(0), pl.program_id(1)
    ps = page_size
    kv_head = kvg_ref[j]
    q = q_ref[...]  # [M, D], scaled, in the dots' dtype
    qpos = qpos_ref[...]  # [M], -1 for an empty row
    # pages [lo, hi) hold every key a row can see: up to its last position, from its window's start
    qmax = jnp.max(qpos)
    hi = jnp.where(qmax >= 0, jax.lax.div(jnp.maximum(qmax, 0), ps) + 1, 0)
    hi = jnp.minimum(hi, nb_ref[0] * pages_per_block)
    lo = 0
    if window:
        first = jnp.min(jnp.where(qpos >= 0, qpos, _FAR))
        lo = jax.lax.div(jnp.maximum(first - window + 1, 0), ps)
    if tree:
        base, anc = base_ref[...], anc_ref[...]
    exact = q.dtype == jnp.float32  # fp32 K/V: full-precision dots (no tf32)

    def body(i, carry):
        m, l, acc = carry
        row = pages_ref[n, i] * rows + 2 * layer * ps
        k = kv_ref[pl.ds(row, ps), kv_head, :].astype(q.dtype)  # [ps, D]
        v = kv_ref[pl.ds(row + ps, ps), kv_head, :].astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=not exact)  # [M, ps] fp32
        key_pos = i * ps + jax.lax.broadcasted_iota(jnp.int32, (1, ps), 1)
        mask = key_pos <= qpos[:, None]
        if window:
            mask &= qpos[:, None] - key_pos < window
        if tree:
            off = key_pos - base[:, None]
            bit = jnp.right_shift(anc[:, None], jnp.clip(off, 0, 31)) & 1
            mask &= (off < 0) | (bit == 1)
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=not exact)
        return m_new, l, acc

    rows_, d = q.shape
    if sinks:  # the online softmax starts from each row's sink logit (running max = sink, sum = 1)
        init = (sink_ref[...], jnp.ones((rows_,), jnp.float32), jnp.zeros((rows_, d), jnp.float32))
    else:
        init = (jnp.full((rows_,), _NEG, jnp.float32), jnp.zeros((rows_,), jnp.float32),
                jnp.zeros((rows_, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


def ragged_paged_attention(q: jax.Array, arena: jax.Array, spec: PoolSpec, mesh: Mesh, layer: int,
                           meta: AttentionMetadata, pages_per_block: int, window: int = 0,
                           sinks: jax.Array | None = None, *,
                           interpret: bool | None = None, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """The reference's attention with layer `layer`'s K/V read by the kernel from `arena` (viewed as
    `spec` on `mesh`) instead of through a `read` function; the other arguments and the result as in
    `talaria_jax.engine.paged_attention.ragged_paged_attention`. interpret: run the Pallas
    interpreter (True) or Triton (False); None: by the platform the program is lowered for
    (`jax.lax.platform_dependent`): Triton for CUDA or ROCm, the interpreter elsewhere, so a program
    lowered for CUDA on a machine without a GPU holds the GPU's kernel. On a GPU mesh, or with Triton
    asked for, page_size and head_dim must suit it (`check_shapes`: a ValueError naming the field);
    lowered for a GPU from elsewhere, shapes it cannot tile keep the interpreter."""
    page_tables, pos, tile_tok, tile_seq, tok_slot, num_blocks, tree = (
        meta.page_tables, meta.pos, meta.tile_tok, meta.tile_seq, meta.tok_slot, meta.num_blocks, meta.tree)
    check_shapes(spec.page_size, spec.head_dim, on_gpu(mesh) or interpret is False)
    t, h, d = q.shape
    kvh = spec.kv_heads
    if h % kvh:
        raise ValueError(f"q heads ({h}) must be a multiple of kv_heads ({kvh})")
    g = h // kvh
    qspec = spec_for((None, "heads", "head_dim"), q.shape, mesh)
    h_loc = h // (1 if qspec[1] is None else mesh.shape[qspec[1]])
    kvh_loc = view_sharding(spec, mesh).shard_shape(spec.shape)[2]
    gs = math.gcd(h_loc, g)  # G': q heads per group, all of one kv head
    nt, qt = tile_tok.shape
    m = _pow2_rows(qt * gs)
    # q of each tile slot [NT, Q, H, D] (a gather of q, not of K/V), scaled; an empty slot reads a zero row
    dot_dtype = jnp.float32 if jnp.dtype(spec.dtype) == jnp.float32 else (
        jnp.dtype(spec.dtype) if jnp.dtype(spec.dtype).itemsize == 2 else jnp.bfloat16)
    q_pad = jnp.concatenate([q, jnp.zeros((1, h, d), q.dtype)])
    qtiles = (q_pad[tile_tok].astype(jnp.float32) * (d ** -0.5)).astype(dot_dtype)
    pos_pad = jnp.concatenate([pos, jnp.full((1,), -1, pos.dtype)])

    def rows_of(a):  # per-slot [NT, Q] -> per-row [NT, M] (each slot's value for its G' heads, then padding)
        a = jnp.repeat(a, gs, axis=1)
        return jnp.pad(a, ((0, 0), (0, m - qt * gs)), constant_values=-1)

    meta = [rows_of(pos_pad[tile_tok].astype(jnp.int32))]
    if tree is not None:
        meta += [rows_of(jnp.concatenate([a.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])[tile_tok]) for a in tree]
    sink_logits = [] if sinks is None else [sinks.astype(jnp.float32)]  # [H], split over devices as q's heads
    tile_pages = page_tables[tile_seq].astype(jnp.int32)  # [NT, MP]: each tile's page-table row
    nb = jnp.reshape(num_blocks, (1,)).astype(jnp.int32)
    head_ids = jnp.arange(h, dtype=jnp.int32)  # sharded as q's heads: each device's global q head ids

    def local(rows, qtiles, head_ids, tile_pages, nb, tok_slot, *meta_and_sinks):
        groups = h_loc // gs
        meta = list(meta_and_sinks[:len(meta_and_sinks) - len(sink_logits)])
        if sink_logits:  # each group's rows (slot x G' + head) get their head's sink; padding rows none
            rows_sink = jnp.tile(meta_and_sinks[-1].reshape(groups, gs), (1, qt))
            meta.append(jnp.pad(rows_sink, ((0, 0), (0, m - qt * gs)), constant_values=_NEG))
        kvg = (head_ids[::gs] // g) % kvh_loc  # each group's kv head among the device's own
        flat = local_view(rows, spec).reshape(spec.num_pages * spec.rows, kvh_loc, d)
        qg = qtiles.reshape(nt, qt, groups, gs, d).transpose(0, 2, 1, 3, 4).reshape(nt, groups, qt * gs, d)
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, m - qt * gs), (0, 0)))
        row_spec = pl.BlockSpec((None, m), lambda i, j: (i, 0))
        kernel = functools.partial(_kernel, page_size=spec.page_size, rows=spec.rows, layer=layer,
                                   pages_per_block=pages_per_block, window=window, tree=tree is not None,
                                   sinks=bool(sink_logits))
        group_spec = [pl.BlockSpec((None, m), lambda i, j: (j, 0))] * len(sink_logits)
        def call(interpreted: bool, *args):
            return pl.pallas_call(
                kernel,
                out_shape=jax.ShapeDtypeStruct((nt, groups, m, d), q.dtype),
                grid=(nt, groups),
                # num_blocks, the tiles' pages, each group's kv head and the arena rows: whole refs
                in_specs=[pl.no_block_spec] * 4 + [pl.BlockSpec((None, None, m, d), lambda i, j: (i, j, 0, 0)),
                                                   *[row_spec] * (len(meta) - len(sink_logits)), *group_spec],
                out_specs=pl.BlockSpec((None, None, m, d), lambda i, j: (i, j, 0, 0)),
                interpret=interpreted,
                compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                name=f"ragged_paged_attention_m{m}_ps{spec.page_size}",
            )(*args)

        args = (nb, tile_pages, kvg, flat, qg, *meta)
        if interpret is not None:
            out = call(interpret, *args)
        else:
            gpu = {} if not triton_fits(spec.page_size, spec.head_dim) else dict(
                cuda=functools.partial(call, False), rocm=functools.partial(call, False))
            out = jax.lax.platform_dependent(*args, default=functools.partial(call, True), **gpu)
        out = out[:, :, :qt * gs].reshape(nt, groups, qt, gs, d).transpose(0, 2, 1, 3, 4).reshape(nt * qt, h_loc, d)
        return jnp.concatenate([out, jnp.zeros((1, h_loc, d), out.dtype)])[tok_slot]

    heads = P(None, None, qspec[1], None)
    fn = on_each_device(local, mesh, (arena_sharding(mesh).spec, heads, P(qspec[1]), P(), P(), P(), *[P()] * len(meta),
                                      *[P(qspec[1])] * len(sink_logits)), qspec)
    return fn(arena, qtiles, head_ids, tile_pages, nb, tok_slot, *meta, *sink_logits)
