"""HF-format checkpoints (config.json + *.safetensors) for Llama, Qwen3 and Qwen3-MoE, loaded
straight into sharded arrays: each device receives only its shard of every parameter.
"""
from __future__ import annotations

import collections
import hashlib
import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from tqdm.auto import tqdm

from talaria_jax.models.config import ModelConfig, MoEConfig, RopeScaling, default_compute_dtype
from talaria_jax.models.model import ShardedModel, abstract_model, weights_fingerprint
from talaria_jax.sharding import make_mesh, mesh_platform

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "glm4_moe")
# Compute dtypes a checkpoint's own dtype may select (config.json `dtype` / safetensors dtype codes).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
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
    unsupported = {"hidden_act": hf.get("hidden_act", "silu") != "silu", "mlp_bias": bool(hf.get("mlp_bias")),
                   "use_sliding_window": bool(hf.get("use_sliding_window")),
                   "layer_types": any(t != "full_attention" for t in hf.get("layer_types") or [])}
    bad = [f"{k}={hf.get(k)!r}" for k, v in unsupported.items() if v]
    if bad:
        raise CheckpointError(f"config.json: {', '.join(bad)} not supported (silu, no MLP bias, full attention)")
    heads = hf["num_attention_heads"]
    rope_scaling = None
    rs = hf.get("rope_scaling") or (hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else None)
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        rope_scaling = RopeScaling("llama3", float(rs["factor"]), float(rs["low_freq_factor"]),
                                   float(rs["high_freq_factor"]), int(rs["original_max_position_embeddings"]))
    elif rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
        raise CheckpointError(f"config.json rope_scaling type {rs.get('rope_type')!r} is not supported (llama3 is)")
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
    return ModelConfig(
        name=name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_size=hf["intermediate_size"],
        rope_theta=float(theta), rope_scaling=rope_scaling, norm_eps=float(hf["rms_norm_eps"]),
        qk_norm=mt in ("qwen3", "qwen3_moe") or bool(hf.get("use_qk_norm")), partial_rotary_factor=float(partial_rotary),
        attention_bias=bool(hf.get("attention_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe,
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


def name_map(cfg: ModelConfig) -> dict[str, tuple[list[str], Callable[..., np.ndarray]]]:
    """{our path: ([HF tensor names], fn(*tensors) -> array in our layout)}."""
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = lambda w: w  # noqa: E731
    t = lambda w: w.T  # noqa: E731
    m: dict[str, tuple[list[str], Callable[..., np.ndarray]]] = {"embed": (["model.embed_tokens.weight"], ident),
                                                                 "final_norm": (["model.norm.weight"], ident)}
    if not cfg.tie_embeddings:
        m["lm_head"] = (["lm_head.weight"], t)
    for i in range(cfg.num_layers):
        hp, op = f"model.layers.{i}", f"blocks.{i}"
        m[f"{op}.input_norm"] = ([f"{hp}.input_layernorm.weight"], ident)
        m[f"{op}.post_attn_norm"] = ([f"{hp}.post_attention_layernorm.weight"], ident)
        a = f"{hp}.self_attn"
        m[f"{op}.attn.q_proj"] = ([f"{a}.q_proj.weight"], _proj_in(h, d))
        m[f"{op}.attn.k_proj"] = ([f"{a}.k_proj.weight"], _proj_in(kv, d))
        m[f"{op}.attn.v_proj"] = ([f"{a}.v_proj.weight"], _proj_in(kv, d))
        m[f"{op}.attn.o_proj"] = ([f"{a}.o_proj.weight"], _proj_out(h, d))
        if cfg.attention_bias:
            for p, n in (("q", h), ("k", kv), ("v", kv)):
                m[f"{op}.attn.{p}_bias"] = ([f"{a}.{p}_proj.bias"], lambda b, n=n: b.reshape(n, d))
        if cfg.qk_norm:
            m[f"{op}.attn.q_norm"] = ([f"{a}.q_norm.weight"], ident)
            m[f"{op}.attn.k_norm"] = ([f"{a}.k_norm.weight"], ident)
        if cfg.is_moe_layer(i):
            x = cfg.moe.num_experts
            m[f"{op}.ffn.router"] = ([f"{hp}.mlp.gate.weight"], t)
            if cfg.moe.router_scoring == "sigmoid":
                m[f"{op}.ffn.score_bias"] = ([f"{hp}.mlp.gate.e_score_correction_bias"], ident)
            for p in ("gate_proj", "up_proj", "down_proj"):
                names = [f"{hp}.mlp.experts.{e}.{p}.weight" for e in range(x)]
                m[f"{op}.ffn.{p}"] = (names, lambda *ws: np.stack([w.T for w in ws]))
            if cfg.moe.num_shared_experts:
                for p in ("gate_proj", "up_proj", "down_proj"):
                    m[f"{op}.ffn.shared.{p}"] = ([f"{hp}.mlp.shared_experts.{p}.weight"], t)
        else:
            for p in ("gate_proj", "up_proj", "down_proj"):
                m[f"{op}.ffn.{p}"] = ([f"{hp}.mlp.{p}.weight"], t)
    return m


class _SafetensorsDir:
    """Lazy access to every tensor of a checkpoint directory (one or many .safetensors files)."""

    def __init__(self, path: pathlib.Path):
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise CheckpointError(f"no *.safetensors files in {path}")
        self._handles = [safe_open(str(f), framework="numpy") for f in self.files]
        self.index = {k: h for h in self._handles for k in h.keys()}

    def get(self, name: str) -> np.ndarray:
        if name not in self.index:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        return self.index[name].get_tensor(name)

    def dtype(self) -> str | None:
        """Our name of the tensors' most common dtype (matrices outnumber fp32 norms); None if it is not a
        compute dtype (e.g. int or fp8). Reads headers only."""
        counts = collections.Counter(h.get_slice(k).get_dtype() for k, h in self.index.items())
        return _SAFETENSORS_DTYPES.get(counts.most_common(1)[0][0])


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
                progress: bool = True, label: Callable[[str], str] = str) -> tuple[ShardedModel, set[str]]:
    """Builds every parameter of `cfg` on `mesh` from `get(hf_name) -> host array` (HF names and layout,
    see `name_map`), each device receiving only its shard; returns the model and the HF names used.

    Each tensor is checked against the shape the config implies; a mismatch raises CheckpointError
    naming the tensor (as `label(hf_name)` shows it) and both shapes.
    """
    graphdef, abstract, shardings = abstract_model(cfg, mesh)
    nmap = name_map(cfg)
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
    GPU or TPU bfloat16 where that is float32: `default_compute_dtype`). Every tensor is checked
    against the shape the config implies; a mismatch raises CheckpointError naming the parameter. `fingerprint` digests the config (with its dtype) and the safetensors files.

    Raises:
        CheckpointError: no config.json and no `cfg`, a tensor whose shape is not the config's (named),
            or tensors the config does not use.
    """
    path = pathlib.Path(path)
    mesh = mesh or make_mesh(jax.devices()[:1])
    st = _SafetensorsDir(path)
    config_file = path / "config.json"
    if cfg is None:
        if not config_file.exists():
            raise CheckpointError(f"no config.json in {path} (pass cfg= to load without one)")
        hf = json.loads(config_file.read_text())
        own = checkpoint_dtype(hf, st, str(config_file))
        cfg = config_from_hf(hf, name=path.name, dtype=dtype or default_compute_dtype(own, mesh_platform(mesh)),
                             source=str(config_file))
        gen = path / "generation_config.json"
        if gen.exists():  # instruct checkpoints list their end-of-turn ids here
            extra = [i for i in _ids(json.loads(gen.read_text()).get("eos_token_id")) if i not in cfg.eos_ids]
            cfg = cfg.replace(extra_eos_token_ids=cfg.extra_eos_token_ids + tuple(extra))
    elif dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    # The config (less its display name) and the tensor files decide the numbers; the folder's name does not.
    digests = [file_digest(f, _safetensors_header_end(f)) for f in st.files]
    fingerprint = weights_fingerprint("hf", repr(cfg.replace(name="")), *digests)
    model, used = build_model(cfg, mesh, st.get, fingerprint, desc=f"loading {path.name}", progress=progress)
    unused = sorted(set(st.index) - used)
    biases = [n for n in unused if n.endswith(".bias")]
    if biases:  # a bias this config does not expect would be silently dropped: wrong outputs
        raise CheckpointError(f"checkpoint has {len(biases)} bias tensors the config does not use, e.g. {biases[0]!r}")
    if unused:
        logging.warning("%d checkpoint tensors not used, e.g. %s", len(unused), unused[:3])
    return model


def _hf_shape(tensors: list[np.ndarray]) -> Any:
    return tensors[0].shape if len(tensors) == 1 else f"{len(tensors)} x {tensors[0].shape}"
