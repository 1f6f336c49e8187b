"""Roofline cost model of one TP instance: prefill, decode step, copies and weight switches.

Times are seconds. A phase takes the larger of its compute time (FLOPs over the matmul rate times
a calibrated efficiency) and its memory time (bytes over HBM bandwidth times an efficiency), plus
the tensor-parallel all-reduces (two per layer: after attention and after the MLP). The constants
come from the hardware config, whose comments cite docs/references.md.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from talaria_jax.sim.hardware import GB, HardwareConfig, ModelShape

_ALLREDUCES_PER_LAYER = 2  # Megatron-style TP: one after attention, one after the MLP
_ACT_BYTES = 2  # bf16 activations on the all-reduce wire


@dataclasses.dataclass(frozen=True)
class CostModel:
    """hw: the profile's rates. tiles: how the engine lays out a step (`engine.runner.TileRules`, or
    anything with its `walk`), or None: each sequence's attention reads its own context once, as a
    ragged kernel's does. With it, `prefill_batch_s` prices a step as the jnp reference runs it:
    tokens padded to the step's bucket, the step's KV read once, and every query tile walking the
    longest sequence's pages (at ``tile_walk_efficiency``)."""
    hw: HardwareConfig
    tiles: object | None = None

    # --- compute phases -------------------------------------------------------------------
    def _matmul_rate(self) -> float:
        return self.hw.num_gpus * self.hw.matmul_tflops * 1e12 * self.hw.prefill_efficiency

    def _hbm_rate(self) -> float:
        return self.hw.num_gpus * self.hw.hbm_bw_gbps * GB * self.hw.hbm_bw_efficiency

    def _roofline(self, compute: float, memory: float) -> float:
        """A step's compute and memory time together: the longer, plus the shorter's part that does not
        overlap it (`compute_memory_overlap`)."""
        return max(compute, memory) + (1.0 - self.hw.compute_memory_overlap) * min(compute, memory)

    def _overhead_s(self) -> float:
        return self.hw.step_overhead_us * 1e-6

    def _allreduce_s(self, m: ModelShape, tokens: int) -> float:
        if self.hw.num_gpus == 1:
            return 0.0
        # ring all-reduce moves 2(n-1)/n of the message over each GPU's link
        n = self.hw.num_gpus
        wire = tokens * m.hidden * _ACT_BYTES * 2 * (n - 1) / n / (self.hw.nvlink_gbps * GB)
        return m.layers * _ALLREDUCES_PER_LAYER * (self.hw.allreduce_latency_us * 1e-6 + wire)

    def prefill_flops(self, m: ModelShape, new_tokens: int, past_tokens: int) -> float:
        """FLOPs to prefill new_tokens after past_tokens of cached context (causal attention)."""
        return 2.0 * m.active_params_b * 1e9 * new_tokens + self.prefill_attention_flops(m, new_tokens, past_tokens)

    def prefill_attention_flops(self, m: ModelShape, new_tokens: int, past_tokens: int) -> float:
        """Of `prefill_flops`, attention's: each new token attends to past + its causal half of the new
        span (QK^T and PV, 2 FLOPs a multiply-add)."""
        return 4.0 * m.full_attn_layers * m.attn_dim * (past_tokens + new_tokens / 2.0) * new_tokens

    def step_work(self, m: ModelShape, chunks: Sequence[tuple[int, int]]) -> tuple[int, float, float, float, float]:
        """What one step of `chunks` (new tokens, cached tokens; none empty) does beside reading the
        weights: (tokens it runs, KV bytes read once (each chunk's context and tokens), KV bytes its
        query tiles walk (0 without `tiles`), FLOPs, of those the attention's that run at
        ``attention_efficiency`` of the matmul rate). Without `tiles`: each chunk's tokens and its
        FLOPs (`prefill_flops`), the attention of the chunks of several tokens at its own rate (a
        decoding sequence's one token is bound by its KV reads, as in `decode_step_s`). With `tiles`
        (the chunks within one step's budget): the tokens padded to the step's bucket, and each query
        tile walking and attending to every key it visits (`walk`) in every layer (a sliding window
        only masks there), at the attention rate where a tile holds several queries."""
        kv = sum(n + p for n, p in chunks) * m.kv_bytes_per_token
        if self.tiles is None:
            return (sum(n for n, _ in chunks), kv, 0.0, sum(self.prefill_flops(m, n, p) for n, p in chunks),
                    sum(self.prefill_attention_flops(m, n, p) for n, p in chunks if n > 1))
        tokens, tiles, rows, keys = self.tiles.walk(chunks)
        every_layer = m.layers / max(1, m.full_attn_layers)  # kv_bytes_per_token counts full-attention layers only
        attention = 4.0 * m.layers * m.attn_dim * tiles * rows * keys
        return (tokens, kv, tiles * keys * m.kv_bytes_per_token * every_layer,
                2.0 * m.active_params_b * 1e9 * tokens + attention, attention if rows > 1 else 0.0)

    def decode_flops(self, m: ModelShape, batch: int, context_tokens: int) -> float:
        """FLOPs of a decode step of `batch` sequences over `context_tokens` of context in all."""
        return 2.0 * m.active_params_b * 1e9 * batch + 4.0 * m.full_attn_layers * m.attn_dim * context_tokens

    def prefill_s(self, m: ModelShape, new_tokens: int, past_tokens: int = 0) -> float:
        """Seconds to prefill new_tokens on top of past_tokens cached (0 when nothing is new)."""
        return self.prefill_batch_s(m, [(new_tokens, past_tokens)])

    def prefill_batch_s(self, m: ModelShape, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of one prefill step over several sequences, each (new tokens, cached tokens): their
        FLOPs add up, but the weights are read once for the whole batch (each sequence's KV once;
        with `tiles`, as `step_work` lays the step out)."""
        chunks = [(n, p) for n, p in chunks if n > 0]
        if not chunks:
            return 0.0
        tokens, kv, walked, flops, attention = self.step_work(m, chunks)
        compute = (flops + attention * (1.0 / self.hw.attention_efficiency - 1.0)) / self._matmul_rate()
        walk = walked / self.hw.tile_walk_efficiency if walked else 0.0
        memory = (m.weight_bytes + kv / self.hw.kv_bw_efficiency + walk) / self._hbm_rate()
        return self._roofline(compute, memory) + self._allreduce_s(m, tokens) + self._overhead_s()

    def verify_batch_s(self, m: ModelShape, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of a step that verifies drafts: `prefill_batch_s` of its chunks (each sequence's
        token and drafts, its cached tokens), and `verify_overhead_s`."""
        return self.prefill_batch_s(m, chunks) + self.verify_overhead_s(chunks)

    def verify_overhead_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """What verifying drafts adds to a step of `chunks`: ``verify_token_overhead_us`` per token."""
        return sum(n for n, _ in chunks) * self.hw.verify_token_overhead_us * 1e-6

    def expert_touch_fraction(self, m: ModelShape, batch: int) -> float:
        """Expected share of routed experts read by a decode step of `batch` tokens."""
        if m.num_experts == 0:
            return 1.0
        return 1.0 - (1.0 - m.top_k / m.num_experts) ** batch

    def decode_step_s(self, m: ModelShape, batch: int, context_tokens: int) -> float:
        """Seconds for one decode step of `batch` sequences holding context_tokens KV in total."""
        if batch <= 0:
            return 0.0
        weights = m.weight_bytes * ((1.0 - m.expert_fraction) + m.expert_fraction * self.expert_touch_fraction(m, batch))
        # kv_bytes_per_token already counts only full-attention layers; sliding-window layers read at
        # most their window per sequence (gpt-oss: 128 tokens x 18 layers x 2 KiB = 4.7 MB), left out
        kv = context_tokens * m.kv_bytes_per_token / self.hw.kv_bw_efficiency
        memory = (weights + kv) / self._hbm_rate()
        compute = self.decode_flops(m, batch, context_tokens) / self._matmul_rate()
        return self._roofline(compute, memory) + self._allreduce_s(m, batch) + self._overhead_s()

    def service_s(self, m: ModelShape, prompt_tokens: int, output_tokens: int, cached: int, batch: int,
                  context_tokens: int) -> float:
        """A call's estimated seconds on an instance: prefill of its uncached prompt, then its output
        decoded in a batch of `batch` sequences holding context_tokens in total."""
        return (self.prefill_s(m, prompt_tokens - cached, cached)
                + output_tokens * self.decode_step_s(m, batch, context_tokens))

    def batch_s(self, m: ModelShape, calls: Sequence[tuple[int, int, int]]) -> float:
        """Estimated seconds of calls (prompt tokens, output tokens, cached tokens) run together from
        an idle instance: one prefill step over their uncached prompts, then decode steps as one
        batch until the longest output ends (its context the prompts plus half the longest output)."""
        if not calls:
            return 0.0
        return (self.prefill_batch_s(m, [(max(0, p - c), min(c, p)) for p, _, c in calls])
                + self.decode_run_s(m, len(calls), sum(p for p, _, _ in calls), max(o for _, o, _ in calls)))

    def decode_run_s(self, m: ModelShape, batch: int, context_tokens: int, steps: int) -> float:
        """Seconds of `steps` decode steps of a batch holding `context_tokens` at the first, each step
        priced at the run's middle context (every sequence grown by half the steps)."""
        return steps * self.decode_step_s(m, batch, context_tokens + batch * steps // 2)

    # --- copies ---------------------------------------------------------------------------
    def h2d_kv_s(self, m: ModelShape, tokens: int) -> float:
        """Seconds to restore `tokens` of session KV from host memory (all GPUs' links in parallel)."""
        return tokens * m.kv_bytes_per_token / (self.hw.num_gpus * self.hw.pcie_h2d_gbps * GB)

    def weight_load_rate(self) -> float:
        """Bytes/s of a host-to-device weight load over all GPUs (sleep-mode wake calibration)."""
        return self.hw.num_gpus * self.hw.pcie_h2d_gbps * GB * self.hw.weight_load_efficiency

    def weight_load_s(self, m: ModelShape) -> float:
        """A full switch from host memory: every weight byte crosses PCIe."""
        return m.weight_bytes / self.weight_load_rate()

    def d2d_weights_s(self, m: ModelShape) -> float:
        """Staging area to the weight slot inside HBM; the d2d figure counts bytes read + written."""
        return 2.0 * m.weight_bytes / (self.hw.num_gpus * self.hw.d2d_gbps * GB)

    def saturated_prefill_tokens_per_s(self, m: ModelShape, input_tokens: int, batch: int = 16) -> float:
        """Prefill throughput of `batch` fresh prompts of input_tokens each (for calibration)."""
        per = self.prefill_s(m, input_tokens * batch, 0)
        # causal attention inside each prompt, not across the batch: correct the cross-prompt term
        attn_cross = 4.0 * m.full_attn_layers * m.attn_dim * (input_tokens * batch) ** 2 / 2.0
        attn_own = 4.0 * m.full_attn_layers * m.attn_dim * batch * input_tokens**2 / 2.0
        per -= (attn_cross - attn_own) / (self._matmul_rate() * self.hw.attention_efficiency)
        return input_tokens * batch / per
