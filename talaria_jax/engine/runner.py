"""The model runner: one jitted ragged step over a paged KV pool held in donated device buffers.

A step takes a flat batch of tokens in which each sequence contributes some query tokens (a
prefill chunk, one decode token, later k draft tokens), writes their K/V into the pool, attends
over each sequence's pages, and samples at the rows asked for. The pool is donated into the step
and re-bound from its output, so its device buffers keep their addresses. Token counts are padded
to a few buckets; `compilations` counts traces, so a steady workload can be checked to add none.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from talaria_jax.engine.paged_attention import ragged_paged_attention, write_kv
from talaria_jax.engine.sampling import SamplingBatch, sample
from talaria_jax.kvcache.pool import PoolSpec, allocate_pool, pool_shardings
from talaria_jax.models.model import ShardedModel
from talaria_jax.sharding import replicated


@dataclasses.dataclass
class StepBatch:
    """Host arrays for one step, already padded to the runner's static shapes except `tokens`' bucket."""
    tokens: np.ndarray       # i32 [T]
    positions: np.ndarray    # i32 [T]
    seq: np.ndarray          # i32 [T], row of page_tables each token belongs to
    slots: np.ndarray        # i32 [T], flat KV slot to write; num_slots for padding (dropped)
    page_tables: np.ndarray  # i32 [B, MP]
    num_blocks: int          # page blocks the longest sequence needs
    logits_idx: np.ndarray   # i32 [R], token index whose logits each sampling row uses
    sampling: SamplingBatch


@dataclasses.dataclass
class StepOutput:
    tokens: np.ndarray       # i32 [R]
    logprobs: np.ndarray     # f32 [R]
    top_ids: np.ndarray      # i32 [R, N]
    top_logprobs: np.ndarray  # f32 [R, N]
    logits: jax.Array        # f32 [R, V], left on device (fetch only when needed: a verifier, a test)


def token_buckets(max_tokens: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from `smallest` up to (and including) max_tokens."""
    out, b = [], smallest
    while b < max_tokens:
        out.append(b)
        b *= 2
    return (*out, max_tokens)


class Runner:
    def __init__(self, model: ShardedModel, spec: PoolSpec, *, max_seqs: int, max_pages_per_seq: int,
                 max_tokens_per_step: int, pages_per_block: int = 4):
        self.model = model
        self.spec = spec
        self.max_seqs = max_seqs
        self.pages_per_block = pages_per_block
        # Page-table width: whole blocks, so the attention loop's dynamic slices never run past it.
        self.table_width = -(-max_pages_per_seq // pages_per_block) * pages_per_block
        self.buckets = token_buckets(max_tokens_per_step)
        self.compilations = 0
        self.kv = allocate_pool(spec, model.mesh)
        rep = replicated(model.mesh)
        self._step = jax.jit(self._step_fn, static_argnums=0, donate_argnames=("kv",),
                             out_shardings=(pool_shardings(spec, model.mesh), rep, rep, rep, rep, rep))

    def reset_pool(self) -> None:
        """A fresh zeroed pool (after a failed step may have consumed the donated one)."""
        self.kv = allocate_pool(self.spec, self.model.mesh)

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the step budget {self.buckets[-1]}")

    def _step_fn(self, graphdef, params, kv, tokens, positions, seq, slots, page_tables, num_blocks, logits_idx,
                 temperature, top_k, top_p, seed, step):
        self.compilations += 1  # runs at trace time only
        model = nnx.merge(graphdef, params)
        cfg = model.cfg
        ppb = self.pages_per_block

        def attn(layer, q, k, v, kv_state):
            pk, pv = write_kv(*kv_state[layer], k, v, slots)
            out = ragged_paged_attention(q, pk, pv, page_tables, seq, positions, num_blocks, ppb, cfg.window(layer))
            return out, kv_state[:layer] + ((pk, pv),) + kv_state[layer + 1:]

        h, kv = model.hidden(tokens, positions, attn, kv)
        logits = model.logits(h[logits_idx])
        return (kv, *sample(logits, temperature, top_k, top_p, seed, step), logits)

    def step(self, b: StepBatch) -> StepOutput:
        s = b.sampling
        with jax.set_mesh(self.model.mesh):
            self.kv, *out = self._step(
                self.model.graphdef, self.model.state, self.kv, b.tokens, b.positions, b.seq, b.slots,
                b.page_tables, np.int32(b.num_blocks), b.logits_idx, s.temperature, s.top_k, s.top_p, s.seed, s.step)
        toks, lp, top_ids, top_lp = jax.device_get(out[:4])
        return StepOutput(toks, lp, top_ids, top_lp, out[4])

    def empty_batch(self, num_tokens: int) -> StepBatch:
        """A padded batch of the bucket for num_tokens: every token writes out of bounds."""
        t = self.bucket(num_tokens)
        return StepBatch(
            tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), seq=np.zeros(t, np.int32),
            slots=np.full(t, self.spec.num_slots, np.int32),
            page_tables=np.zeros((self.max_seqs, self.table_width), np.int32), num_blocks=0,
            logits_idx=np.zeros(self.max_seqs, np.int32), sampling=SamplingBatch.empty(self.max_seqs))
