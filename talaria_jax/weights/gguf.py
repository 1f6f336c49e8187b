"""GGUF files (llama.cpp's format) for the llama, qwen2 and qwen3 architectures, dequantized on the host
and loaded into sharded arrays through the HF loader's machinery (`hf.build_model`).

Supported tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. Block layouts
follow ggml's `block_*` structs (ggml-common.h); every decoder here is vectorised over blocks.

The `gguf` package (llama.cpp's reader) is imported on first use, so that talaria_jax.weights imports
without it; reading a GGUF file without it raises `GGUFPackageMissing`.
"""
from __future__ import annotations

import functools
import pathlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh

from talaria_jax import gguf_reader
from talaria_jax.models.config import ModelConfig, default_compute_dtype
from talaria_jax.models.model import ShardedModel, weights_fingerprint
from talaria_jax.sharding import make_mesh, mesh_platform
from talaria_jax.weights.hf import FULL_HASH_BYTES, CheckpointError, build_model, file_digest

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader


class GGUFPackageMissing(CheckpointError, gguf_reader.GGUFPackageMissing):
    """A GGUF file was to be read and the gguf package is not installed."""


def gguf_package():
    """The gguf package, imported on first use (see the module docstring)."""
    try:
        return gguf_reader.gguf_package()
    except gguf_reader.GGUFPackageMissing as e:
        raise GGUFPackageMissing(str(e)) from None


SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_FREQS = "rope_freqs.weight"  # per-frequency RoPE divisors (Llama-3 scaling); read into the config

QK, QK_K = 32, 256


@functools.cache
def _blocks() -> dict[T, tuple[int, int]]:
    """BLOCKS: (values per block, bytes per block) of ggml's block structs, by the gguf package's tensor
    type (so built on first use)."""
    T = gguf_package().GGMLQuantizationType
    return {
        T.F32: (1, 4), T.F16: (1, 2), T.BF16: (1, 2),
        T.Q4_0: (QK, 2 + QK // 2),                       # d, 32 x 4-bit
        T.Q4_1: (QK, 4 + QK // 2),                       # d, m, 32 x 4-bit
        T.Q5_0: (QK, 2 + 4 + QK // 2),                   # d, 32 high bits, 32 x 4-bit
        T.Q5_1: (QK, 4 + 4 + QK // 2),                   # d, m, 32 high bits, 32 x 4-bit
        T.Q8_0: (QK, 2 + QK),                            # d, 32 x int8
        T.Q4_K: (QK_K, 4 + 12 + QK_K // 2),              # d, dmin, 8 x 6-bit (scale, min), 256 x 4-bit
        T.Q5_K: (QK_K, 4 + 12 + QK_K // 8 + QK_K // 2),  # ... as Q4_K plus 256 high bits
        T.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),  # 256 x low 4, 256 x high 2, 16 int8 scales, d
    }


def __getattr__(name: str):
    if name == "BLOCKS":  # module attribute built on first use (it needs the gguf package)
        return _blocks()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Metadata keys (after "{arch}.") that change the maths in ways this decoder does not run, with the values
# that are harmless (absent keys are fine).
_UNSUPPORTED_KEYS: dict[str, tuple] = {
    "expert_count": (0,), "expert_used_count": (0,), "expert_shared_count": (0,),
    "attention.sliding_window": (0,), "rope.scaling.type": ("none",), "rope.scaling.factor": (0.0, 1.0),
    "rope.scaling.attn_factor": (1.0,), "logit_scale": (1.0,), "embedding_scale": (1.0,), "residual_scale": (1.0,),
    "attention.scale": (), "attention.clamp_kqv": (0.0,), "attn_logit_softcapping": (0.0,),
    "final_logit_softcapping": (0.0,), "attention.causal": (True,), "use_parallel_residual": (False,),
}

# GGUF tensor names (llama.cpp's tensor_mapping) -> the HF names `hf.name_map` reads.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


# ---- dequantization: raw blocks uint8 [n, bytes per block] -> float32 [n, values per block] ----------
def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block, as float32 [n, 1]."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # ggml packs element j in the low nibble of byte j and element j + 16 in its high nibble.
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _high_bits(b: np.ndarray, at: int) -> np.ndarray:
    """Bit i of the little-endian uint32 at byte `at` for i = 0..31: the 5th bit of element i, [n, 32]."""
    qh = np.ascontiguousarray(b[:, at:at + 4]).view("<u4")
    return ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:]).astype(np.float32) - 8)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_high_bits(b, 2) << 4)
    return _f16(b, 0) * (q.astype(np.float32) - 16)


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_high_bits(b, 4) << 4)
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def _q8_0(b):
    return _f16(b, 0) * b.view(np.int8)[:, 2:].astype(np.float32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed in 12 bytes (ggml's get_scale_min_k4), each [n, 8]."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 63, (c & 0xF) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    # Each 32-byte group holds sub-block 2j in its low nibbles and 2j+1 in its high ones: [n, 8, 32].
    g = qs.reshape(len(qs), 4, 1, 32)
    return np.concatenate([g & 0xF, g >> 4], axis=2).reshape(len(qs), 8, 32)


def _q4_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    d, m = _f16(b, 0) * sc, _f16(b, 2) * mn  # per sub-block, as ggml: (d * sc) * q - dmin * m
    return (d[:, :, None] * _k_nibbles(b[:, 16:]).astype(np.float32) - m[:, :, None]).reshape(len(b), QK_K)


def _q5_k(b):
    sc, mn = _k_scales(b[:, 4:16])
    d, m = _f16(b, 0) * sc, _f16(b, 2) * mn
    qh = b[:, 16:48]  # bit k of byte l is the 5th bit of element l of sub-block k
    hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = _k_nibbles(b[:, 48:]) | (hi << 4)
    return (d[:, :, None] * q.astype(np.float32) - m[:, :, None]).reshape(len(b), QK_K)


def _q6_k(b):
    n = len(b)
    ql = b[:, :128].reshape(n, 2, 1, 2, 32)  # two 128-value halves, each 64 bytes as two 32-byte rows
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    sc = b.view(np.int8)[:, 192:208].astype(np.float32).reshape(n, 2, 4, 2, 1)
    # Per half: groups of 32 are (low nibbles row 0, row 1, high nibbles row 0, row 1); group g takes bits 2g, 2g+1.
    lo4 = np.concatenate([ql & 0xF, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    hi2 = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = ((lo4 | (hi2 << 4)).astype(np.float32) - 32).reshape(n, 2, 4, 2, 16)  # one int8 scale per 16 values
    return ((_f16(b, 208).reshape(n, 1, 1, 1, 1) * sc) * q).reshape(n, QK_K)


@functools.cache
def _decoders() -> dict[T, Callable[[np.ndarray], np.ndarray]]:
    T = gguf_package().GGMLQuantizationType
    return {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
            T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}


def dequantize(raw: np.ndarray, qtype: T | int, shape: tuple[int, ...], name: str = "tensor") -> np.ndarray:
    """float32 values of shape `shape` (numpy order, last dim = ggml's ne0) from a tensor's raw bytes.

    Unsupported types and byte counts that do not match the shape raise CheckpointError naming `name`.
    """
    T, blocks = gguf_package().GGMLQuantizationType, _blocks()
    try:
        qtype = T(int(qtype))
    except ValueError:
        raise CheckpointError(f"GGUF tensor {name!r}: unknown ggml type id {int(qtype)}") from None
    if qtype not in blocks:
        raise CheckpointError(f"GGUF tensor {name!r}: type {qtype.name} is not supported; supported: "
                              f"{[t.name for t in blocks]}")
    per_block, block_bytes = blocks[qtype]
    n = int(np.prod(shape))
    if not shape or shape[-1] % per_block:
        raise CheckpointError(f"GGUF tensor {name!r}: row length {shape[-1] if shape else 0} is not a multiple "
                              f"of the {qtype.name} block size {per_block}")
    b = np.asarray(raw).reshape(-1).view(np.uint8)
    if b.size != n // per_block * block_bytes:
        raise CheckpointError(f"GGUF tensor {name!r}: {b.size} bytes, {qtype.name} {tuple(shape)} needs "
                              f"{n // per_block * block_bytes}")
    if qtype == T.F32:
        out = b.view("<f4").astype(np.float32)
    elif qtype == T.F16:
        out = b.view("<f2").astype(np.float32)
    elif qtype == T.BF16:  # bf16 is the top half of an fp32
        out = (b.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        out = _decoders()[qtype](b.reshape(-1, block_bytes))
    return out.reshape(shape)


# ---- config ---------------------------------------------------------------------------------------
def _open(path: pathlib.Path) -> GGUFReader:
    reader_class = gguf_package().GGUFReader
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = reader_class(path)
    except Exception as e:  # the reader raises ValueError/struct/IndexError on truncated or corrupt files
        raise CheckpointError(f"GGUF file {str(path)!r} cannot be parsed (truncated or corrupt?): "
                              f"{type(e).__name__}: {e}") from None
    if reader.endianess.name != "LITTLE":  # quantized blocks are decoded as little-endian
        raise CheckpointError(f"GGUF file {str(path)!r} is {reader.endianess.name.lower()}-endian; "
                              "little-endian is supported")
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise CheckpointError(f"GGUF file {str(path)!r} is truncated: tensor data ends at byte {end}, "
                              f"the file has {path.stat().st_size}")
    return reader


def _field(reader: GGUFReader, key: str, default=None, *, required: bool = False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise CheckpointError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def _int(reader: GGUFReader, key: str, default=None, *, required: bool = False) -> int | None:
    """An integer field (None if absent without default); a per-layer array (some converters write head
    counts so) must be uniform."""
    v = _field(reader, key, default, required=required)
    if v is None:
        return None
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise CheckpointError(f"GGUF metadata {key} varies per layer ({sorted(set(v))}); "
                                  "uniform layers are supported")
        v = v[0]
    return int(v)


def _default_dtype(reader: GGUFReader) -> str:
    """bfloat16/float16 for files whose matrices are all stored so; float32 otherwise: quantized values
    (fp16 scale x small int) are exact in fp32 and llama.cpp dequantizes to fp32, while a bf16 cast would
    round them a second time."""
    T = gguf_package().GGMLQuantizationType
    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    return {frozenset({T.BF16}): "bfloat16", frozenset({T.F16}): "float16"}.get(frozenset(kinds), "float32")


def _config(reader: GGUFReader, name: str, dtype: str) -> ModelConfig:
    arch = _field(reader, "general.architecture", required=True)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; "
                              f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    for suffix, harmless in _UNSUPPORTED_KEYS.items():
        v = _field(reader, f"{arch}.{suffix}")
        if v is not None and v not in harmless:
            raise CheckpointError(f"GGUF metadata {arch}.{suffix}={v!r} is not supported by this decoder")
    tensors = {t.name: t for t in reader.tensors}

    def key(k, default=None, **kw):
        return _int(reader, f"{arch}.{k}", default, **kw)

    heads = key("attention.head_count", required=True)
    hidden = key("embedding_length", required=True)
    head_dim = key("attention.key_length", hidden // heads)
    factors = ()
    if ROPE_FREQS in tensors:  # Llama-3 RoPE scaling, stored as a divisor per frequency rather than as metadata
        t = tensors[ROPE_FREQS]
        factors = tuple(float(f) for f in dequantize(t.data, t.tensor_type, (int(t.n_elements),), ROPE_FREQS))
        if len(factors) != head_dim // 2:
            raise CheckpointError(f"GGUF tensor {ROPE_FREQS!r} has {len(factors)} factors; the head size "
                                  f"{head_dim} needs {head_dim // 2}")
    if key("attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"GGUF metadata {arch}.attention.value_length={key('attention.value_length')} differs "
                              f"from key_length {head_dim}; equal lengths are supported")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"GGUF metadata {arch}.rope.dimension_count={key('rope.dimension_count')} is not the "
                              f"head size {head_dim}; partial rotary is not supported for GGUF")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size", len(tokens.data) if tokens else None)  # .data: one index per token, no decoding
    if vocab is None:
        raise CheckpointError(f"GGUF metadata {arch}.vocab_size is missing and there is no tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    extra = [int(i) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
             if (i := _field(reader, k)) is not None and i != eos]
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=name, vocab_size=vocab, hidden_size=hidden, num_layers=key("block_count", required=True),
        num_heads=heads, num_kv_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
        ffn_size=key("feed_forward_length", required=True),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),  # llama.cpp's default when absent
        rope_freq_factors=factors,
        norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", required=True)),
        qk_norm=arch == "qwen3", attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        tie_embeddings="output.weight" not in tensors, max_position=key("context_length", 32768),
        dtype=dtype, weight_dtype=dtype, kv_dtype=dtype,
        bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
        extra_eos_token_ids=tuple(dict.fromkeys(extra)))


def _digest(reader: GGUFReader, path: pathlib.Path) -> str:
    return file_digest(path, data_start=reader.data_offset)


def gguf_fingerprint(path: str | pathlib.Path) -> str:
    """A digest of a GGUF file's bytes (sha256 of all of it up to 1 GiB, see `hf.file_digest`) that
    changes with its weights and metadata; cheap enough (~0.1 s per 100 MB) to key caches by."""
    path = pathlib.Path(path)
    if path.stat().st_size <= FULL_HASH_BYTES:  # all bytes are hashed: skip the reader (seconds of parsing)
        return file_digest(path)
    return _digest(_open(path), path)


def config_from_gguf(path: str | pathlib.Path, name: str | None = None, dtype: str = "float32") -> ModelConfig:
    """Our ModelConfig from a GGUF file's metadata (architectures llama, qwen2, qwen3).

    Llama-3 RoPE scaling stored as `rope_freqs.weight` becomes `rope_freq_factors`. Metadata that changes
    the maths and is not implemented (experts, sliding windows, other RoPE scaling, ...) raises
    CheckpointError naming the key.
    """
    path = pathlib.Path(path)
    return _config(_open(path), name or path.stem, dtype)


# ---- tensors --------------------------------------------------------------------------------------
def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name of a GGUF tensor name ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight')."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes convert_hf_to_gguf.py's llama q/k row order (interleaved RoPE pairs) back to HF's
    rotate-half order: within each head, rows [0, d/2, 1, d/2+1, ...] -> [0, 1, ..., d-1]."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | pathlib.Path, mesh: Mesh | None = None, dtype: str | None = None,
              progress: bool = True) -> ShardedModel:
    """Loads a GGUF file into a ShardedModel on `mesh` (default: one device), each device receiving only
    its shard; tensors are dequantized to float32 on the host one at a time.

    dtype None computes in float32 for quantized files on CPU, bfloat16 on an accelerator (see
    `_default_dtype` and `default_compute_dtype`); an explicit dtype is honoured. Unparseable or
    truncated files, unsupported architectures, metadata or tensor types, and tensors the config does
    not use raise CheckpointError naming them. `fingerprint` digests the file's
    bytes (`gguf_fingerprint`) with the config, compute dtype included.
    """
    path = pathlib.Path(path)
    reader = _open(path)
    mesh = mesh or make_mesh(jax.devices()[:1])
    cfg = _config(reader, path.stem, dtype or default_compute_dtype(_default_dtype(reader), mesh_platform(mesh)))
    by_hf = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # in the config (rope_freq_factors), not a parameter
            continue
        n = hf_name(t.name)
        if n is None:
            raise CheckpointError(f"GGUF tensor {t.name!r} has no counterpart in this decoder")
        by_hf[n] = t
    permuted = _field(reader, "general.architecture") == "llama"  # qwen2/qwen3 are stored unpermuted (NEOX RoPE)

    def get(name: str) -> np.ndarray:
        t = by_hf.get(name)
        if t is None:
            raise CheckpointError(f"GGUF file {str(path)!r} is missing tensor {_gguf_label(name)!r}")
        w = dequantize(t.data, t.tensor_type, tuple(reversed(t.shape.tolist())), t.name)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        return w

    fingerprint = weights_fingerprint("gguf", repr(cfg.replace(name="")), _digest(reader, path))
    model, used = build_model(cfg, mesh, get, fingerprint,
                              desc=f"loading {path.name}", progress=progress, label=_gguf_label)
    unused = sorted(_gguf_label(n) for n in set(by_hf) - used)
    if unused:  # e.g. an output bias or q/k norms in an architecture that has none: dropping them is wrong
        raise CheckpointError(f"GGUF file {str(path)!r} has {len(unused)} tensors this config does not use, "
                              f"e.g. {unused[0]!r}")
    return model


def _gguf_label(name: str) -> str:
    """The GGUF spelling of an HF tensor name (the inverse of `hf_name`), for messages."""
    base, _, kind = name.rpartition(".")
    for g, h in _GLOBAL_NAMES.items():
        if base == h:
            return f"{g}.{kind}"
    m = _HF_BLOCK_RE.fullmatch(base)
    inverse = {v: k for k, v in _BLOCK_NAMES.items()}
    return f"blk.{m.group(1)}.{inverse[m.group(2)]}.{kind}" if m and m.group(2) in inverse else name
