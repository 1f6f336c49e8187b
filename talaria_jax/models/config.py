"""Decoder configs (dense and MoE) as frozen dataclasses, loaded from configs/models/*.yaml.

One dataclass covers Llama-3, Qwen3, Qwen3-MoE, GLM-4.5 and gpt-oss shapes. Each config reports its
parameter count (total and active per token) and its KV bytes per token, the figures the
simulator's cost model is built from (talaria_jax/sim/hardware.py).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib

from talaria_jax import config_io
from talaria_jax.models.quant import QuantConfig

MODEL_CONFIG_DIR = config_io.CONFIG_DIR / "models"

# Bytes per stored weight; mxfp4 is 4-bit values plus one 8-bit scale per 32 (OCP MX format).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1, "mxfp4": 0.53125}
# SwiGLU FFNs have three matrices: gate, up and down.
_FFN_MATRICES = 3


def bytes_per_weight(dtype: str) -> float:
    """Bytes per stored weight of a precision name; unknown names raise ConfigError listing the known."""
    if dtype not in _DTYPE_BYTES:
        raise config_io.ConfigError(f"precision {dtype!r} not in {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def default_compute_dtype(source: str, platform: str) -> str:
    """The compute dtype a checkpoint loads in when none is asked for. `source` is its own (float32 for
    quantized files: their fp16-scaled small ints are exact in fp32); `platform` the devices' ("cpu",
    "gpu", "tpu"). On CPU it stays the source's: fp32 is what the CPU path is built and tested in. On an
    accelerator a float32 source computes in bfloat16, weights and KV (half the bytes per decode step,
    on a memory-bound step the speed-up is ~2x); the engine keeps fp32 where precision matters:
    matmul accumulation (XLA's default for bf16 dots on GPU), RMSNorm, attention's softmax and
    accumulators, the MoE router and the logits. A 16-bit source keeps its own dtype."""
    return "bfloat16" if platform != "cpu" and source == "float32" else source


def with_default_compute_dtype(cfg: "ModelConfig", platform: str) -> "ModelConfig":
    """`cfg` as it loads on `platform` when no dtype is asked for: `default_compute_dtype` applied to
    its compute, weight and KV dtypes each (so an fp8 or mxfp4 storage dtype is kept)."""
    return cfg.replace(**{f: default_compute_dtype(getattr(cfg, f), platform)
                          for f in ("dtype", "weight_dtype", "kv_dtype")})


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3's (`rope_type: llama3`: factor, low/high_freq_factor) or YaRN
    (`yarn`, gpt-oss: factor, beta_fast/beta_slow, truncate; cos and sin scaled by 0.1 ln(factor) + 1),
    both as HF's modeling_rope_utils computes them."""
    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_ffn_size: int
    num_shared_experts: int = 0
    norm_topk_prob: bool = True
    # "softmax" (Qwen3-MoE, gpt-oss) or "sigmoid" (GLM-4.5, with a score-correction bias).
    router_scoring: str = "softmax"
    routed_scaling_factor: float = 1.0
    # Leading layers that keep a dense FFN (GLM-4.5's first_k_dense_replace).
    first_dense_layers: int = 0
    # gpt-oss: a bias on the router's logits and on each expert's projections, and SwiGLU clamped at
    # `swiglu_limit` (0: plain SwiGLU): min(g, L) * sigmoid(alpha * min(g, L)) * (clip(u, -L, L) + 1).
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors of RoPE's inverse frequencies (rotary_dim / 2 of them): how GGUF files store
    # Llama-3 scaling (llama.cpp's `rope_freqs` tensor); empty = none.
    rope_freq_factors: tuple[float, ...] = ()
    # Fraction of head_dim that is rotated (GLM-4.5: 0.5).
    partial_rotary_factor: float = 1.0
    norm_eps: float = 1e-6
    qk_norm: bool = False
    attention_bias: bool = False
    # A bias on the output projection too (gpt-oss), and a learned per-head logit that joins each
    # query's softmax and takes its share of the probability without a value (gpt-oss's sinks).
    attention_out_bias: bool = False
    attention_sinks: bool = False
    tie_embeddings: bool = False
    moe: MoEConfig | None = None
    # Linear weights stored quantized (FP8 with block or channel scales, MXFP4 experts) as the
    # checkpoint ships them, dequantized inside the step (talaria_jax/models/quant.py); None = every
    # weight in `dtype`.
    quant: QuantConfig | None = None
    # Per-layer sliding window in tokens, 0 = full attention; empty = all layers full.
    sliding_windows: tuple[int, ...] = ()
    max_position: int = 32768
    # Storage precision of the served weights (those `quant` leaves unquantized) and KV, for byte
    # accounting; not the compute dtype.
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    # Compute dtype of the JAX model (fp32 on CPU, bf16 on GPU).
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # More end-of-sequence ids (Llama-3.1-Instruct ends turns with <|eot_id|> as well as <|end_of_text|>).
    extra_eos_token_ids: tuple[int, ...] = ()
    # Published figures the counts are checked against (tests/models/test_model_config.py).
    published_params: float | None = None
    published_active_params: float | None = None
    # Features present in the real model that this decoder does not run (documented, not silently wrong).
    unsupported: tuple[str, ...] = ()

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_size"):
            if getattr(self, field) < 1:
                raise config_io.ConfigError(f"{self.name}: {field} must be >= 1, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise config_io.ConfigError(
                f"{self.name}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise config_io.ConfigError(
                f"{self.name}: sliding_windows has {len(self.sliding_windows)} entries, num_layers is {self.num_layers}")
        if self.moe is not None and not 1 <= self.moe.top_k <= self.moe.num_experts:
            raise config_io.ConfigError(
                f"{self.name}: moe.top_k ({self.moe.top_k}) must be in [1, moe.num_experts={self.moe.num_experts}]")
        if self.rope_freq_factors:
            if len(self.rope_freq_factors) != self.rotary_dim // 2:
                raise config_io.ConfigError(f"{self.name}: rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                                            f"rotary_dim / 2 is {self.rotary_dim // 2}")
            if self.rope_scaling is not None:
                raise config_io.ConfigError(f"{self.name}: set rope_scaling or rope_freq_factors, not both")
        for field in ("weight_dtype", "kv_dtype"):
            if getattr(self, field) not in _DTYPE_BYTES:
                raise config_io.ConfigError(f"{self.name}: {field} {getattr(self, field)!r} not in {sorted(_DTYPE_BYTES)}")

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence."""
        return tuple(dict.fromkeys(([self.eos_token_id] if self.eos_token_id is not None else [])
                                   + list(self.extra_eos_token_ids)))

    def window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.first_dense_layers

    # ---- counts -----------------------------------------------------------------------------
    def _attn_params(self) -> int:
        p = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.attention_bias:
            p += self.q_size + 2 * self.kv_size
        if self.attention_out_bias:
            p += self.hidden_size
        if self.attention_sinks:
            p += self.num_heads
        if self.qk_norm:
            p += 2 * self.head_dim
        return p + 2 * self.hidden_size  # two RMSNorms per layer

    def _ffn_params(self, layer: int) -> tuple[int, int]:
        """(total, active per token) parameters of one layer's FFN."""
        if not self.is_moe_layer(layer):
            p = _FFN_MATRICES * self.hidden_size * self.ffn_size
            return p, p
        m = self.moe
        expert = _FFN_MATRICES * self.hidden_size * m.expert_ffn_size
        # the router, its bias (gpt-oss) or score-correction bias (GLM-4.5's sigmoid scoring)
        router = self.hidden_size * m.num_experts + m.num_experts * (m.router_bias + (m.router_scoring == "sigmoid"))
        if m.expert_bias:
            expert += 2 * m.expert_ffn_size + self.hidden_size
        shared = m.num_shared_experts * _FFN_MATRICES * self.hidden_size * m.expert_ffn_size
        return m.num_experts * expert + shared + router, m.top_k * expert + shared + router

    def param_count(self) -> int:
        """All parameters: embeddings, layers, final norm and (untied) LM head."""
        emb = self.vocab_size * self.hidden_size
        total = emb * (1 if self.tie_embeddings else 2) + self.hidden_size
        for layer in range(self.num_layers):
            total += self._attn_params() + self._ffn_params(layer)[0]
        return total

    def active_param_count(self) -> int:
        """Parameters touched per token: layers with top-k experts, plus the LM head (not the embedding lookup)."""
        total = self.vocab_size * self.hidden_size + self.hidden_size
        for layer in range(self.num_layers):
            total += self._attn_params() + self._ffn_params(layer)[1]
        return total

    def routed_expert_params(self) -> int:
        """Parameters of all routed experts (their matrices and biases; not shared experts or routers):
        the weights a decode step reads only for the experts its tokens touch."""
        if self.moe is None:
            return 0
        m = self.moe
        per_expert = _FFN_MATRICES * self.hidden_size * m.expert_ffn_size
        if m.expert_bias:
            per_expert += 2 * m.expert_ffn_size + self.hidden_size
        return m.num_experts * per_expert * sum(1 for layer in range(self.num_layers) if self.is_moe_layer(layer))

    def kv_bytes_per_token(self, full_attention: bool = False) -> int:
        """2 x layers x kv_heads x head_dim x bytes (docs/references.md). Sliding-window layers hold a
        bounded window, so by default only full-attention layers count per token."""
        layers = self.num_layers if full_attention else sum(1 for l in range(self.num_layers) if self.window(l) == 0)
        return int(2 * layers * self.kv_size * _DTYPE_BYTES[self.kv_dtype])

    def linear_weights(self) -> list[tuple[str, int, int, int]]:
        """(our parameter path, out, in, matrices) of every weight a quantized checkpoint may store
        quantized: the attention and FFN projections (experts: one matrix each), not the embeddings,
        LM head, norms, biases or router."""
        out = []
        for i in range(self.num_layers):
            b = f"blocks.{i}"
            e = self.hidden_size
            out += [(f"{b}.attn.q_proj", self.q_size, e, 1), (f"{b}.attn.k_proj", self.kv_size, e, 1),
                    (f"{b}.attn.v_proj", self.kv_size, e, 1), (f"{b}.attn.o_proj", e, self.q_size, 1)]
            if self.is_moe_layer(i):
                m = self.moe
                f, x = m.expert_ffn_size, m.num_experts
                out += [(f"{b}.ffn.gate_proj", f, e, x), (f"{b}.ffn.up_proj", f, e, x), (f"{b}.ffn.down_proj", e, f, x)]
                if m.num_shared_experts:
                    fs = m.num_shared_experts * f
                    out += [(f"{b}.ffn.shared.gate_proj", fs, e, 1), (f"{b}.ffn.shared.up_proj", fs, e, 1),
                            (f"{b}.ffn.shared.down_proj", e, fs, 1)]
            else:
                f = self.ffn_size
                out += [(f"{b}.ffn.gate_proj", f, e, 1), (f"{b}.ffn.up_proj", f, e, 1), (f"{b}.ffn.down_proj", e, f, 1)]
        return out

    def _quantized_delta(self, select=lambda path: True) -> tuple[float, float]:
        """(bytes of the selected linear weights as stored, the same at `weight_dtype`)."""
        q, dense = self.quant, _DTYPE_BYTES[self.weight_dtype]
        stored = plain = 0.0
        for path, o, i, n in self.linear_weights():
            if not select(path):
                continue
            plain += o * i * n * dense
            if q is None or not q.quantizes(path):
                stored += o * i * n * dense
                continue
            bo, bi = q.block[0] or o, q.block[1] or i
            stored += n * (o * i * (1 if q.method == "fp8" else 0.5)
                           + math.ceil(o / bo) * math.ceil(i / bi) * q.scale_dtype.itemsize)
        return stored, plain

    def weight_bytes(self) -> int:
        """Bytes of the weights as served: every parameter at `weight_dtype`, except the linear weights
        `quant` stores quantized, which count their values and their scales."""
        stored, plain = self._quantized_delta()
        return int(self.param_count() * _DTYPE_BYTES[self.weight_dtype] - plain + stored)

    def routed_expert_bytes(self) -> int:
        """Bytes of the routed experts' matrices as served (their biases aside)."""
        if self.moe is None:
            return 0
        return int(self._quantized_delta(lambda p: p.split(".")[2:3] == ["ffn"] and ".shared." not in p
                                         and self.is_moe_layer(int(p.split(".")[1])))[0])

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def available_models() -> list[str]:
    return sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml"))


def load_model_config(name_or_path: str | pathlib.Path) -> ModelConfig:
    """Loads `configs/models/<name>.yaml` (or an explicit path)."""
    path = pathlib.Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = MODEL_CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise config_io.ConfigError(f"no model config {str(name_or_path)!r}; available: {available_models()}")
    return config_io.load_yaml(ModelConfig, path)
