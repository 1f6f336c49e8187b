"""HF-format checkpoints (config.json + *.safetensors) for Llama, Qwen3, Qwen3-MoE, GLM-4.5 and
gpt-oss, loaded straight into sharded arrays: each device receives only its shard of every parameter.

Quantized checkpoints load in their own precision (`quantization_config` in config.json): FP8 e4m3
with 128 x 128 block scales (`quant_method: fp8`, `weight_scale_inv`: Qwen3-FP8, GLM-4.5-FP8,
DeepSeek), per output channel (`fbgemm_fp8`, `weight_scale`: Meta's Llama-3.1-405B-FP8; or
`compressed-tensors` with channel, tensor or block strategy: the RedHatAI / Neural Magic FP8
checkpoints) or per tensor (`fp8` without blocks), and MXFP4 experts (`mxfp4`, `_blocks` /
`_scales`: gpt-oss). Each quantized matrix keeps its stored values and scales (models/quant.py);
which matrices are quantized is read from the tensors themselves, so a checkpoint's
`modules_to_not_convert` needs no parsing.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from tqdm.auto import tqdm

from talaria_jax.models import quant
from talaria_jax.models.config import ModelConfig, MoEConfig, RopeScaling, default_compute_dtype
from talaria_jax.models.model import ShardedModel, abstract_model, weights_fingerprint
from talaria_jax.models.decoder import linear_axes
from talaria_jax.models.quant import QuantConfig
from talaria_jax.sharding import make_mesh, mesh_platform

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "glm4_moe", "gpt_oss")
# config.json quantization_config.quant_method values this loader reads (module docstring).
QUANT_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors", "mxfp4")
# Compute dtypes a checkpoint's own dtype may select (config.json `dtype` / safetensors dtype codes).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# dtypes safetensors' numpy reader cannot return, read from the file's bytes instead
_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
# HF's own defaults for `norm_topk_prob` when config.json omits it (Qwen3MoeConfig: False, Glm4MoeConfig: True).
_NORM_TOPK_DEFAULT = {"qwen3_moe": False, "glm4_moe": True}
# Files up to this size are hashed whole for the fingerprint (sha256 runs at ~1 GB/s); larger ones are sampled.
FULL_HASH_BYTES = 1 << 30
_HASH_SAMPLES, _HASH_SAMPLE_BYTES = 64, 1 << 16


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: names the parameter and both shapes."""


class _Required(dict):
    """A config dict whose missing keys raise CheckpointError naming the key and the file."""

    def __init__(self, d: dict, source: str):
        super().__init__(d)
        self.source = source

    def __missing__(self, key):
        raise CheckpointError(f"{self.source}: required key {key!r} is missing")


def config_from_hf(hf: dict, name: str = "hf-model", dtype: str = "float32",
                   source: str = "config.json") -> ModelConfig:
    """Our ModelConfig from an HF config.json dict (model_type llama, qwen3, qwen3_moe or glm4_moe).

    A missing required key raises CheckpointError naming it and `source`; optional keys take HF's defaults.
    """
    hf = _Required(hf, source)
    mt = hf.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"config.json model_type {mt!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}")
    # Fields that change the maths and that this decoder does not implement: refuse rather than run wrong.
    layer_types = hf.get("layer_types") or []
    unsupported = {"hidden_act": hf.get("hidden_act", "silu") != "silu", "mlp_bias": bool(hf.get("mlp_bias")),
                   "use_sliding_window": bool(hf.get("use_sliding_window")),
                   "layer_types": any(t not in ("full_attention", "sliding_attention") for t in layer_types)
                   or (mt != "gpt_oss" and any(t != "full_attention" for t in layer_types))}
    bad = [f"{k}={hf.get(k)!r}" for k, v in unsupported.items() if v]
    if bad:
        raise CheckpointError(f"config.json: {', '.join(bad)} not supported (silu, no MLP bias, full attention "
                              "or gpt-oss's sliding layers)")
    heads = hf["num_attention_heads"]
    rope_scaling = None
    rs = hf.get("rope_scaling") or (hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else None)
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        rope_scaling = RopeScaling("llama3", float(rs["factor"]), float(rs["low_freq_factor"]),
                                   float(rs["high_freq_factor"]), int(rs["original_max_position_embeddings"]))
    elif rs and rs.get("rope_type", rs.get("type")) == "yarn":
        if rs.get("attention_factor") is not None or rs.get("mscale") or rs.get("mscale_all_dim"):
            raise CheckpointError("config.json rope_scaling: yarn with attention_factor / mscale is not supported")
        missing = [k for k in ("factor", "original_max_position_embeddings") if rs.get(k) is None]
        if missing:
            raise CheckpointError(f"config.json rope_scaling: yarn needs {missing}")
        rope_scaling = RopeScaling("yarn", float(rs["factor"]),
                                   original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                                   beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                                   truncate=bool(rs.get("truncate", True)))
    elif rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
        raise CheckpointError(f"config.json rope_scaling type {rs.get('rope_type')!r} is not supported "
                              "(llama3 and yarn are)")
    theta = hf.get("rope_theta") or (rs or {}).get("rope_theta") or 10000.0
    partial_rotary = hf.get("partial_rotary_factor") or (rs or {}).get("partial_rotary_factor") or 1.0
    eos = _ids(hf.get("eos_token_id"))
    moe = None
    if mt == "qwen3_moe":
        dense = sorted(hf.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))) or hf.get("decoder_sparse_step", 1) != 1:
            raise CheckpointError(f"qwen3_moe: only leading dense layers are supported; mlp_only_layers={dense}, "
                                  f"decoder_sparse_step={hf.get('decoder_sparse_step')}")
        moe = MoEConfig(num_experts=hf.get("num_experts") or hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                        expert_ffn_size=hf["moe_intermediate_size"],
                        norm_topk_prob=bool(hf.get("norm_topk_prob", _NORM_TOPK_DEFAULT[mt])),
                        first_dense_layers=len(dense))
    elif mt == "glm4_moe":
        if hf.get("n_group", 1) != 1 or hf.get("topk_group", 1) != 1:
            raise CheckpointError(f"glm4_moe: group-limited routing (n_group={hf.get('n_group')}, "
                                  f"topk_group={hf.get('topk_group')}) is not supported; n_group=1 is")
        moe = MoEConfig(num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
                        top_k=hf["num_experts_per_tok"], expert_ffn_size=hf["moe_intermediate_size"],
                        num_shared_experts=hf.get("n_shared_experts", 1),
                        norm_topk_prob=bool(hf.get("norm_topk_prob", _NORM_TOPK_DEFAULT[mt])),
                        router_scoring="sigmoid", routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                        first_dense_layers=hf.get("first_k_dense_replace", 1))
    elif mt == "gpt_oss":  # HF's GptOssExperts clamps at 7.0 with alpha 1.702 (config.json's swiglu_limit)
        moe = MoEConfig(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                        expert_ffn_size=hf["intermediate_size"], norm_topk_prob=True, router_bias=True,
                        expert_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)))
    windows = tuple(int(hf["sliding_window"]) if t == "sliding_attention" else 0 for t in layer_types) \
        if any(t == "sliding_attention" for t in layer_types) else ()
    return ModelConfig(
        name=name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_size=hf["intermediate_size"],
        rope_theta=float(theta), rope_scaling=rope_scaling, norm_eps=float(hf["rms_norm_eps"]),
        qk_norm=mt in ("qwen3", "qwen3_moe") or bool(hf.get("use_qk_norm")), partial_rotary_factor=float(partial_rotary),
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=mt == "gpt_oss" and bool(hf.get("attention_bias", False)), attention_sinks=mt == "gpt_oss",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe, sliding_windows=windows,
        max_position=hf.get("max_position_embeddings", 32768), dtype=dtype, weight_dtype=dtype, kv_dtype=dtype,
        bos_token_id=hf.get("bos_token_id"), eos_token_id=(eos[0] if eos else None), extra_eos_token_ids=tuple(eos[1:]))


def _ids(x) -> list[int]:
    return [] if x is None else list(x) if isinstance(x, list) else [x]


# ---- name map: our parameter path -> how to build it from HF tensors -----------------------------
Getter = Callable[[str], np.ndarray]


def _proj_in(h: int, d: int):  # HF [H*D, E] -> ours [E, H, D]
    return lambda w: w.T.reshape(w.shape[1], h, d)


def _proj_out(h: int, d: int):  # HF [E, H*D] -> ours [H, D, E]
    return lambda w: w.T.reshape(h, d, w.shape[0])


def _scale_in_our_layout(cfg: ModelConfig, path: str, shape: tuple[int, ...]):
    """HF scales [out blocks, in blocks] (one per expert, per-tensor ones as a scalar) -> our scale
    layout [experts..., in blocks..., out blocks...] of the weight `path` of `shape` (ours)."""
    lin = linear_axes(cfg, path)
    target = quant.scale_shape(cfg.quant, shape, lin, path)
    ins, outs = lin.groups(len(shape))
    o, i = math.prod(shape[k] for k in outs), math.prod(shape[k] for k in ins)
    bo, bi = (b or d for b, d in zip(cfg.quant.block, (o, i)))
    want = (-(-o // bo), -(-i // bi))  # the checkpoint's [out blocks, in blocks] of one matrix

    def fn(*scales):
        mats = [np.asarray(s, np.float32).reshape(-1, 1) if np.ndim(s) < 2 else np.asarray(s, np.float32)
                for s in scales]
        if mats[0].shape != want:
            raise CheckpointError(f"{path}_scale: the checkpoint's scales are {mats[0].shape}; a [{o}, {i}] matrix "
                                  f"in blocks of {cfg.quant.block} (out, in) has {want}")
        return np.stack([m.T for m in mats]).reshape(target)
    return fn


def name_map(cfg: ModelConfig, fused_experts: bool = False,
             scale_name: str = "weight_scale_inv") -> dict[str, tuple[list[str], Callable[..., np.ndarray]]]:
    """{our path: ([HF tensor names], fn(*tensors) -> array in our layout)}. `fused_experts`: gpt-oss's
    layout (experts' gate and up interleaved in one `gate_up_proj`, MXFP4 as `_blocks` / `_scales`).
    A linear weight `cfg.quant` stores quantized maps its values from the HF weight and its `_scale`
    from the HF `scale_name` tensor (`weight_scale_inv` for block scales, `weight_scale` otherwise)."""
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    e = cfg.hidden_size
    ident = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731
    m: dict[str, tuple[list[str], Callable[..., np.ndarray]]] = {"embed": (["model.embed_tokens.weight"], ident),
                                                                 "final_norm": (["model.norm.weight"], ident)}
    if not cfg.tie_embeddings:
        m["lm_head"] = (["lm_head.weight"], t)

    def linear(ours: str, hf_names: list[str], fn, shape: tuple[int, ...]):
        m[ours] = (hf_names, fn)
        if cfg.quant is not None and cfg.quant.quantizes(ours):
            m[f"{ours}_scale"] = ([n.removesuffix("weight") + scale_name for n in hf_names],
                                  _scale_in_our_layout(cfg, ours, shape))

    for i in range(cfg.num_layers):
        hp, op = f"model.layers.{i}", f"blocks.{i}"
        m[f"{op}.input_norm"] = ([f"{hp}.input_layernorm.weight"], ident)
        m[f"{op}.post_attn_norm"] = ([f"{hp}.post_attention_layernorm.weight"], ident)
        a = f"{hp}.self_attn"
        linear(f"{op}.attn.q_proj", [f"{a}.q_proj.weight"], _proj_in(h, d), (e, h, d))
        linear(f"{op}.attn.k_proj", [f"{a}.k_proj.weight"], _proj_in(kv, d), (e, kv, d))
        linear(f"{op}.attn.v_proj", [f"{a}.v_proj.weight"], _proj_in(kv, d), (e, kv, d))
        linear(f"{op}.attn.o_proj", [f"{a}.o_proj.weight"], _proj_out(h, d), (h, d, e))
        if cfg.attention_bias:
            for p, n in (("q", h), ("k", kv), ("v", kv)):
                m[f"{op}.attn.{p}_bias"] = ([f"{a}.{p}_proj.bias"], lambda b, n=n: b.reshape(n, d))
        if cfg.attention_out_bias:
            m[f"{op}.attn.o_bias"] = ([f"{a}.o_proj.bias"], ident)
        if cfg.attention_sinks:
            m[f"{op}.attn.sinks"] = ([f"{a}.sinks"], ident)
        if cfg.qk_norm:
            m[f"{op}.attn.q_norm"] = ([f"{a}.q_norm.weight"], ident)
            m[f"{op}.attn.k_norm"] = ([f"{a}.k_norm.weight"], ident)
        if cfg.is_moe_layer(i) and fused_experts:
            _fused_experts(m, cfg, hp, op)
        elif cfg.is_moe_layer(i):
            x, f = cfg.moe.num_experts, cfg.moe.expert_ffn_size
            m[f"{op}.ffn.router"] = ([f"{hp}.mlp.gate.weight"], t)
            if cfg.moe.router_scoring == "sigmoid":
                m[f"{op}.ffn.score_bias"] = ([f"{hp}.mlp.gate.e_score_correction_bias"], ident)
            for p, shape in (("gate_proj", (x, e, f)), ("up_proj", (x, e, f)), ("down_proj", (x, f, e))):
                linear(f"{op}.ffn.{p}", [f"{hp}.mlp.experts.{j}.{p}.weight" for j in range(x)],
                       lambda *ws: np.stack([w.T for w in ws]), shape)
            if cfg.moe.num_shared_experts:
                fs = cfg.moe.num_shared_experts * f
                for p, shape in (("gate_proj", (e, fs)), ("up_proj", (e, fs)), ("down_proj", (fs, e))):
                    linear(f"{op}.ffn.shared.{p}", [f"{hp}.mlp.shared_experts.{p}.weight"], t, shape)
        else:
            f = cfg.ffn_size
            for p, shape in (("gate_proj", (e, f)), ("up_proj", (e, f)), ("down_proj", (f, e))):
                linear(f"{op}.ffn.{p}", [f"{hp}.mlp.{p}.weight"], t, shape)
    return m


def _fused_experts(m: dict, cfg: ModelConfig, hp: str, op: str) -> None:
    """gpt-oss's MoE names: `mlp.router` (weight [X, E], bias) and `mlp.experts.gate_up_proj` [X, E, 2F]
    (gate and up interleaved: gate the even columns) and `down_proj` [X, F, E] with their biases; in
    MXFP4, `gate_up_proj_blocks` [X, 2F, E/32, 16] and `_scales` [X, 2F, E/32] (rows are outputs,
    the packed axis the inputs), `down_proj_blocks` [X, E, F/32, 16] and `_scales` [X, E, F/32]."""
    ex = f"{hp}.mlp.experts"
    m[f"{op}.ffn.router"] = ([f"{hp}.mlp.router.weight"], lambda w: w.T)
    m[f"{op}.ffn.router_bias"] = ([f"{hp}.mlp.router.bias"], lambda b: b)
    m[f"{op}.ffn.gate_bias"] = ([f"{ex}.gate_up_proj_bias"], lambda b: b[:, 0::2])
    m[f"{op}.ffn.up_bias"] = ([f"{ex}.gate_up_proj_bias"], lambda b: b[:, 1::2])
    m[f"{op}.ffn.down_bias"] = ([f"{ex}.down_proj_bias"], lambda b: b)
    mx = cfg.quant is not None and cfg.quant.method == "mxfp4"
    for ours, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
        path = f"{op}.ffn.{ours}"
        if mx and cfg.quant.quantizes(path):  # [X, rows, G, 16] -> ours [X, G * 16 (packed inputs), rows]
            m[path] = ([f"{ex}.gate_up_proj_blocks"],
                       lambda b, r=rows: b[:, r].reshape(b.shape[0], -1, b.shape[2] * b.shape[3]).transpose(0, 2, 1))
            m[f"{path}_scale"] = ([f"{ex}.gate_up_proj_scales"], lambda s, r=rows: s[:, r].transpose(0, 2, 1))
        else:
            m[path] = ([f"{ex}.gate_up_proj"], lambda w, r=rows: w[:, :, r])
    path = f"{op}.ffn.down_proj"
    if mx and cfg.quant.quantizes(path):
        m[path] = ([f"{ex}.down_proj_blocks"],
                   lambda b: b.reshape(b.shape[0], b.shape[1], -1).transpose(0, 2, 1))
        m[f"{path}_scale"] = ([f"{ex}.down_proj_scales"], lambda s: s.transpose(0, 2, 1))
    else:
        m[path] = ([f"{ex}.down_proj"], lambda w: w)


def _scale_tensor_name(names) -> str:
    """The HF name of the fp8 weights' scales among a checkpoint's tensor `names`: `weight_scale_inv`
    (DeepSeek's name for block scales, though they multiply) where present, else `weight_scale`."""
    return "weight_scale_inv" if any(n.endswith(".weight_scale_inv") for n in names) else "weight_scale"


def quant_from_hf(hf: dict, cfg: ModelConfig, st: "_SafetensorsDir", source: str = "config.json",
                  fused_experts: bool = False) -> QuantConfig | None:
    """The QuantConfig of a checkpoint's `quantization_config`, None for an unquantized one. Which
    linear weights are quantized is read from the tensors: an fp8 one's dtype, an MXFP4 one's
    `_blocks`; the others land in `exclude`, folded to `blocks.*.<name>` where no layer quantizes
    them. Activations are not quantized here (the step computes in the compute dtype), so a static
    activation scheme's `input_scale` tensors go unused."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise CheckpointError(f"{source}: quantization_config.quant_method {method!r} is not supported; "
                              f"supported: {list(QUANT_METHODS)}")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{source}: quantization_config fmt={qc.get('fmt')!r}: fp8 weights in e4m3 are "
                                  "supported")
        blk = qc.get("weight_block_size")
        q = QuantConfig("fp8", tuple(blk) if blk else (0, 0))
    elif method == "fbgemm_fp8":
        q = QuantConfig("fp8", (1, 0))
    elif method == "compressed-tensors":
        q = _compressed_tensors(qc, source)
    else:
        q = QuantConfig("mxfp4", (1, quant.MXFP4_BLOCK))
    linear = cfg.linear_weights()
    names = name_map(cfg.replace(quant=None), fused_experts)  # each weight's HF name, unquantized
    plain = []
    for path, *_ in linear:
        hf_name = names[path][0][0]  # (the first expert's)
        if q.method == "fp8":
            stored = st.dtype_of(hf_name) if hf_name in st.index else None
            if stored is not None and stored.startswith("F8") and stored != "F8_E4M3":
                raise CheckpointError(f"{hf_name}: dtype {stored}; fp8 checkpoints are read as F8_E4M3")
            quantized = stored == "F8_E4M3"
        else:
            quantized = fused_experts and ".ffn." in path and f"{hf_name}_blocks" in st.index
        if not quantized:
            plain.append(path)
    if len(plain) == len(linear):
        raise CheckpointError(f"{source}: quantization_config.quant_method={method!r} but no weight is stored "
                              "quantized")
    return dataclasses.replace(q, exclude=_fold_layers(plain, [p for p, *_ in linear]))


def _compressed_tensors(qc: dict, source: str) -> QuantConfig:
    """compressed-tensors' one weight scheme: 8-bit float weights by channel, tensor or block (its
    activation settings do not matter here: the step computes in the compute dtype)."""
    schemes = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
    w = schemes[0] if len(schemes) == 1 else {}
    blocks = {"channel": (1, 0), "tensor": (0, 0), "block": tuple(w.get("block_structure") or ())}
    if w.get("type") != "float" or w.get("num_bits") != 8 or len(blocks.get(w.get("strategy"), ())) != 2:
        raise CheckpointError(f"{source}: compressed-tensors config_groups {schemes}: one group of 8-bit float "
                              "weights by channel, tensor or block is supported")
    return QuantConfig("fp8", blocks[w["strategy"]])


def _fold_layers(chosen: list[str], every: list[str]) -> tuple[str, ...]:
    """`chosen` paths as fnmatch patterns: `blocks.*.<rest>` where every layer's <rest> is chosen."""
    def generic(p):
        return re.sub(r"^blocks\.\d+\.", "blocks.*.", p)
    total = collections.Counter(generic(p) for p in every)
    got = collections.Counter(generic(p) for p in chosen)
    folded = sorted(g for g, n in got.items() if n == total[g])
    return tuple(folded + [p for p in chosen if generic(p) not in folded])


class _SafetensorsDir:
    """Lazy access to every tensor of a checkpoint directory (one or many .safetensors files)."""

    def __init__(self, path: pathlib.Path):
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise CheckpointError(f"no *.safetensors files in {path}")
        self._handles = [safe_open(str(f), framework="numpy") for f in self.files]
        self.index = {k: h for h in self._handles for k in h.keys()}
        self._file = {k: f for f, h in zip(self.files, self._handles) for k in h.keys()}
        self._headers: dict[pathlib.Path, tuple[int, dict]] = {}

    def get(self, name: str) -> np.ndarray:
        if name not in self.index:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        raw = _RAW_DTYPES.get(self.dtype_of(name))
        if raw is not None:  # fp8: the file's bytes viewed as ml_dtypes' float8
            return self._raw(name, raw)
        return self.index[name].get_tensor(name)

    def _raw(self, name: str, dtype) -> np.ndarray:
        path = self._file[name]
        if path not in self._headers:  # each file's header read once
            header_end = _safetensors_header_end(path)
            with path.open("rb") as f:
                f.seek(8)
                self._headers[path] = (header_end, json.loads(f.read(header_end - 8)))
        header_end, header = self._headers[path]
        start, end = header[name]["data_offsets"]
        data = np.fromfile(path, np.uint8, count=end - start, offset=header_end + start)
        return data.view(dtype).reshape(header[name]["shape"])

    def dtype_of(self, name: str) -> str:
        """The safetensors dtype code of one tensor (F32, BF16, F8_E4M3, U8, ...), from its header."""
        return self.index[name].get_slice(name).get_dtype()

    def dtype(self) -> str | None:
        """Our name of the most common compute dtype among the tensors (matrices outnumber fp32 norms;
        fp8 or packed int tensors of a quantized checkpoint are not counted); None if there is none.
        Reads headers only."""
        counts = collections.Counter(self.dtype_of(k) for k in self.index)
        compute = [c for c, _ in counts.most_common() if c in _SAFETENSORS_DTYPES]
        return _SAFETENSORS_DTYPES[compute[0]] if compute else None


def checkpoint_dtype(hf: dict, st: _SafetensorsDir, source: str) -> str:
    """The compute dtype a checkpoint was saved in: config.json `dtype` / `torch_dtype`, else its tensors'."""
    declared = hf.get("dtype") or hf.get("torch_dtype")
    if declared in (None, "auto"):
        declared = st.dtype() or "float32"
    if declared not in COMPUTE_DTYPES:
        raise CheckpointError(f"{source}: dtype {declared!r} is not a compute dtype {list(COMPUTE_DTYPES)}; "
                              "pass dtype= explicitly")
    return declared


def file_digest(path: pathlib.Path, data_start: int = 0) -> str:
    """sha256 of a file's size and bytes: all of them up to 1 GiB, else everything before `data_start`
    (the header) plus 64 evenly spaced 64 KiB samples of the rest (retrained weights differ everywhere)."""
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        if size <= FULL_HASH_BYTES:
            return hashlib.file_digest(f, lambda: h).hexdigest()
        h.update(f.read(data_start))
        for off in np.linspace(data_start, size - _HASH_SAMPLE_BYTES, _HASH_SAMPLES, dtype=np.int64):
            f.seek(int(off))
            h.update(f.read(_HASH_SAMPLE_BYTES))
    return h.hexdigest()


def _safetensors_header_end(path: pathlib.Path) -> int:
    # safetensors: an 8-byte little-endian header length, then the JSON header, then the data.
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def build_model(cfg: ModelConfig, mesh: Mesh, get: Getter, fingerprint: str, desc: str = "loading",
                progress: bool = True, label: Callable[[str], str] = str,
                names: dict | None = None) -> tuple[ShardedModel, set[str]]:
    """Builds every parameter of `cfg` on `mesh` from `get(hf_name) -> host array` (HF names and layout,
    see `name_map`, or `names` where given), each device receiving only its shard; returns the model and
    the HF names used. Quantized weights keep their stored dtype (fp8 values, packed uint8, scales).

    Each tensor is checked against the shape the config implies; a mismatch raises CheckpointError
    naming the tensor (as `label(hf_name)` shows it) and both shapes.
    """
    graphdef, abstract, shardings = abstract_model(cfg, mesh)
    nmap = names if names is not None else name_map(cfg)
    flat_abs = dict(nnx.to_flat_state(abstract))
    flat_sh = dict(nnx.to_flat_state(shardings))
    used: set[str] = set()
    arrays: dict[tuple, jax.Array] = {}
    for key in tqdm(flat_abs, desc=desc, disable=not progress, leave=False):
        ours = ".".join(map(str, key))
        if ours not in nmap:
            raise CheckpointError(f"no HF name for parameter {ours!r} of {cfg.name}")
        hf_names, fn = nmap[ours]
        want = flat_abs[key].get_value()
        tensors = [get(n) for n in hf_names]
        used.update(hf_names)
        try:
            host = np.asarray(fn(*tensors))
        except CheckpointError:  # the map's own check, naming what it found
            raise
        except ValueError as e:  # a reshape that the config's shapes cannot satisfy
            raise CheckpointError(f"parameter {label(hf_names[0])!r} (ours {ours!r}): shape {tensors[0].shape} does "
                                  f"not fit the config's {tuple(want.shape)}: {e}") from None
        if host.shape != tuple(want.shape):
            raise CheckpointError(f"parameter {label(hf_names[0])!r} (ours {ours!r}): checkpoint shape "
                                  f"{_hf_shape(tensors)} gives {host.shape}, config expects {tuple(want.shape)}")
        host = host.astype(want.dtype, copy=False)
        sharding = flat_sh[key].get_value()
        arrays[key] = jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx])
    state = nnx.from_flat_state([(k, flat_abs[k].replace(arrays[k])) for k in flat_abs])
    return ShardedModel(cfg, mesh, graphdef, state, fingerprint), used


def load_hf_checkpoint(path: str | pathlib.Path, mesh: Mesh | None = None, cfg: ModelConfig | None = None,
                       dtype: str | None = None, progress: bool = True) -> ShardedModel:
    """Loads an HF checkpoint directory into a ShardedModel on `mesh` (default: one device).

    The config comes from `cfg` or from the directory's config.json. The compute dtype is `dtype` if
    given, else `cfg.dtype`, else the checkpoint's own (config.json `dtype`, else its tensors'; on a
    GPU or TPU bfloat16 where that is float32: `default_compute_dtype`). A quantized checkpoint
    (config.json `quantization_config`, see the module docstring) keeps its quantized weights as
    stored, with their scales, unless `cfg` says otherwise; the rest loads in the compute dtype.
    Every tensor is checked against the shape the config implies; a mismatch raises CheckpointError
    naming the parameter. `fingerprint` digests the config (with its dtype) and the safetensors files.

    Raises:
        CheckpointError: no config.json and no `cfg`, a tensor whose shape is not the config's (named),
            tensors the config does not use, or a quantization this loader does not read (named).
    """
    path = pathlib.Path(path)
    mesh = mesh or make_mesh(jax.devices()[:1])
    st = _SafetensorsDir(path)
    config_file = path / "config.json"
    hf = json.loads(config_file.read_text()) if config_file.exists() else {}
    if cfg is None:
        if not config_file.exists():
            raise CheckpointError(f"no config.json in {path} (pass cfg= to load without one)")
        own = checkpoint_dtype(hf, st, str(config_file))
        cfg = config_from_hf(hf, name=path.name, dtype=dtype or default_compute_dtype(own, mesh_platform(mesh)),
                             source=str(config_file))
        gen = path / "generation_config.json"
        if gen.exists():  # instruct checkpoints list their end-of-turn ids here
            extra = [i for i in _ids(json.loads(gen.read_text()).get("eos_token_id")) if i not in cfg.eos_ids]
            cfg = cfg.replace(extra_eos_token_ids=cfg.extra_eos_token_ids + tuple(extra))
    elif dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    fused = hf.get("model_type") == "gpt_oss" if hf else bool(cfg.moe and cfg.moe.expert_bias)
    if cfg.quant is None:
        cfg = cfg.replace(quant=quant_from_hf(hf, cfg, st, str(config_file), fused))
    names = name_map(cfg, fused, _scale_tensor_name(st.index))
    # The config (less its display name) and the tensor files decide the numbers; the folder's name does not.
    digests = [file_digest(f, _safetensors_header_end(f)) for f in st.files]
    fingerprint = weights_fingerprint("hf", repr(cfg.replace(name="")), *digests)
    model, used = build_model(cfg, mesh, st.get, fingerprint, desc=f"loading {path.name}", progress=progress,
                              names=names)
    unused = sorted(set(st.index) - used)
    biases = [n for n in unused if n.endswith(".bias")]
    if biases:  # a bias this config does not expect would be silently dropped: wrong outputs
        raise CheckpointError(f"checkpoint has {len(biases)} bias tensors the config does not use, e.g. {biases[0]!r}")
    if unused:
        logging.warning("%d checkpoint tensors not used, e.g. %s", len(unused), unused[:3])
    return model


def _hf_shape(tensors: list[np.ndarray]) -> Any:
    return tensors[0].shape if len(tensors) == 1 else f"{len(tensors)} x {tensors[0].shape}"
