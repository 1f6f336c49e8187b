"""Weights stored as quantized checkpoints ship them, dequantized inside the jitted step.

Two formats, each as the released checkpoints lay it out (docs/models.md, "Quantized checkpoints"):
- **fp8**: float8 e4m3 values with float32 scales, one per block of `block = (out, in)` elements
  (Qwen3-FP8, GLM-4.5-FP8, DeepSeek: 128 x 128 blocks, `weight_scale_inv`), one per output channel
  (`block = (1, 0)`, 0 meaning the whole dimension: Llama-3.1-405B-FP8's `fbgemm_fp8` and
  compressed-tensors' channel strategy), or one per tensor (`(0, 0)`). The real weight is value x scale.
- **mxfp4** (OCP microscaling, gpt-oss's experts): 4-bit e2m1 values packed two a byte (the even
  element in the low nibble) with one uint8 power-of-two exponent (bias 127) per 32 consecutive input
  elements of an output row.

A quantized parameter is two arrays in our layout: the stored values and the scales, whose every
axis is the value's axis divided by its block (rounded up); a scale axis shards like the value's
axis where its blocks line up with the shards, else it is replicated (4 bytes per 16,384 fp8
weights in 128 x 128 blocks, 1 byte per 32 mxfp4 ones). A linear weight's axes are `[batch..., in..., out...]` (experts
first, then the contracted axes, then the produced ones): `LinearAxes` says how many of each, and a
checkpoint's `(out, in)` block maps onto our axes by `blocks`. `layers.dequantize` runs inside the
step, so the resident weights, the weight slot, staging and host copies hold the checkpoint's bytes
(the step holds each matrix in the compute dtype while it uses it). This
module is plain numpy (the simulator's byte arithmetic reads it without JAX).
"""
from __future__ import annotations

import dataclasses
import fnmatch

import ml_dtypes
import numpy as np

from talaria_jax import config_io

METHODS = ("fp8", "mxfp4")
MXFP4_BLOCK = 32  # elements per shared exponent (OCP MX v1.0)
MXFP4_SCALE_BIAS = 127
# e2m1 values by nibble: sign bit 3, exponent bits 2-1, mantissa bit 0 (OCP MX v1.0, table 5)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
FP8_MAX = 448.0  # largest finite float8 e4m3fn


class QuantError(config_io.ConfigError):
    """A quantized weight whose blocks cannot be laid onto our layout: names the parameter and why."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How a model's linear weights are stored. `block` is (out, in) elements per scale in the
    checkpoint's [out, in] matrices, 0 for a whole dimension; `exclude` lists our parameter paths
    (fnmatch patterns, e.g. `blocks.*.attn.*`) kept unquantized in the compute dtype."""
    method: str = "fp8"
    block: tuple[int, int] = (128, 128)
    exclude: tuple[str, ...] = ()

    def __post_init__(self):
        if self.method not in METHODS:
            raise QuantError(f"quant.method {self.method!r} not in {list(METHODS)}")
        if len(self.block) != 2 or any(b < 0 for b in self.block):
            raise QuantError(f"quant.block {self.block} must be two sizes >= 0 (out, in; 0 = the whole dimension)")
        if self.method == "mxfp4" and tuple(self.block) != (1, MXFP4_BLOCK):
            raise QuantError(f"quant.block {self.block}: mxfp4 scales one row's {MXFP4_BLOCK} inputs, (1, 32)")

    def quantizes(self, path: str) -> bool:
        """Whether our parameter `path` (e.g. 'blocks.3.ffn.gate_proj') is stored quantized."""
        return not any(fnmatch.fnmatchcase(path, p) for p in self.exclude)

    @property
    def value_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.float8_e4m3fn) if self.method == "fp8" else np.dtype(np.uint8)

    @property
    def scale_dtype(self) -> np.dtype:
        return np.dtype(np.float32) if self.method == "fp8" else np.dtype(np.uint8)


@dataclasses.dataclass(frozen=True)
class LinearAxes:
    """A linear weight's axes in our layout: `batch` leading axes (experts), then `n_in` contracted
    axes, then the produced ones."""
    batch: int = 0
    n_in: int = 1

    def groups(self, rank: int) -> tuple[range, range]:
        return range(self.batch, self.batch + self.n_in), range(self.batch + self.n_in, rank)


def _group_blocks(dims: tuple[int, ...], block: int, where: str) -> list[int]:
    """Per-axis blocks for a checkpoint block of `block` elements over the row-major flattening of
    `dims` (our heads x head_dim for one HF axis): whole inner axes first, then a part of one axis. The
    outermost axis may end in a partial block (GLM-4.5-Air's 10944-wide FFN: 85.5 blocks of 128), as
    the checkpoint's last block along that HF axis does; an inner axis must tile exactly."""
    if block == 0:
        return list(dims)
    out = [1] * len(dims)
    rest = block
    for i in reversed(range(len(dims))):
        if rest == 1:
            break
        if i == 0:
            out[0] = min(rest, dims[0])
        elif rest >= dims[i] and rest % dims[i] == 0:
            out[i], rest = dims[i], rest // dims[i]
        elif rest < dims[i] and dims[i] % rest == 0:
            out[i], rest = rest, 1
        else:
            raise QuantError(f"{where}: a block of {block} elements does not tile axes {dims}")
    return out


def blocks(q: QuantConfig, shape: tuple[int, ...], axes: LinearAxes, where: str = "weight") -> tuple[int, ...]:
    """Elements per scale along each axis of a weight of (unpacked) `shape` in our layout."""
    ins, outs = axes.groups(len(shape))
    b_out, b_in = q.block
    return (1,) * axes.batch + tuple(_group_blocks(tuple(shape[i] for i in ins), b_in, where)
                                     + _group_blocks(tuple(shape[i] for i in outs), b_out, where))


def scale_shape(q: QuantConfig, shape: tuple[int, ...], axes: LinearAxes, where: str = "weight") -> tuple[int, ...]:
    return tuple(-(-d // b) for d, b in zip(shape, blocks(q, shape, axes, where)))


def packed_axis(q: QuantConfig, axes: LinearAxes) -> int | None:
    """The axis whose element pairs share a byte (mxfp4: the last contracted axis), or None."""
    return axes.batch + axes.n_in - 1 if q.method == "mxfp4" else None


def value_shape(q: QuantConfig, shape: tuple[int, ...], axes: LinearAxes, where: str = "weight") -> tuple[int, ...]:
    """The stored values' shape: `shape`, with mxfp4's packed axis halved."""
    p = packed_axis(q, axes)
    if p is None:
        return tuple(shape)
    if shape[p] % 2:
        raise QuantError(f"{where}: mxfp4 packs element pairs, and axis {p} of {tuple(shape)} is odd")
    return tuple(d // 2 if i == p else d for i, d in enumerate(shape))


def scale_axes(q: QuantConfig, shape: tuple[int, ...], axes: LinearAxes, logical: tuple) -> tuple:
    """The scale's logical axes: the value's where the blocks tile the axis exactly (then the scale's
    shards line up with the value's), None (replicated) where the last block is partial."""
    return tuple(name if d % b == 0 else None for name, d, b in zip(logical, shape, blocks(q, shape, axes)))


# ---- quantizing (the checkpoint writers' side: HF [out, in] matrices) ------------------------------

def quantize_fp8(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """A float [..., out, in] matrix as fp8 e4m3 values and float32 scales [..., out/b, in/b] (the
    multiplier, which checkpoints name `weight_scale_inv` for blocks and `weight_scale` per channel),
    each block's largest magnitude mapped to 448."""
    *lead, o, i = w.shape
    bo, bi = (block[0] or o), (block[1] or i)
    so, si = -(-o // bo), -(-i // bi)
    padded = np.zeros((*lead, so * bo, si * bi), np.float32)
    padded[..., :o, :i] = w
    tiles = padded.reshape(*lead, so, bo, si, bi)
    amax = np.abs(tiles).max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    values = tiles / scale[..., :, None, :, None]
    values = values.reshape(*lead, so * bo, si * bi)[..., :o, :i].astype(ml_dtypes.float8_e4m3fn)
    return values, scale


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float [..., out, in] matrix as gpt-oss stores it: blocks uint8 [..., out, in/32, 16] (two
    e2m1 values a byte, the even element low) and exponents uint8 [..., out, in/32] (bias 127); each
    group's largest magnitude fits 6 x 2^e, values rounded to the nearest e2m1."""
    *lead, o, i = w.shape
    if i % MXFP4_BLOCK:
        raise QuantError(f"mxfp4: the input dimension {i} is not a multiple of {MXFP4_BLOCK}")
    g = w.reshape(*lead, o, i // MXFP4_BLOCK, MXFP4_BLOCK).astype(np.float32)
    amax = np.abs(g).max(-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    e = np.clip(e, -MXFP4_SCALE_BIAS, 255 - MXFP4_SCALE_BIAS)
    x = g / np.exp2(e)[..., None]
    idx = np.abs(x[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)  # nearest e2m1 (+0 before -0)
    packed = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return packed.astype(np.uint8), (e + MXFP4_SCALE_BIAS).astype(np.uint8)
