"""Writes an HF checkpoint in the quantized layouts the released models ship, tensor for tensor.

- `fp8-block`, as Qwen/Qwen3-235B-A22B-FP8 (and GLM-4.5-FP8, DeepSeek-V3): every attention and FFN
  projection (experts and shared experts included) as F8_E4M3 `weight` with a float32
  `weight_scale_inv` [ceil(out/128), ceil(in/128)]; router, embeddings, LM head and norms unchanged.
- `fp8-channel`, as meta-llama/Llama-3.1-405B-Instruct-FP8 (`fbgemm_fp8`): the FFN projections of
  every layer but the first and the last as F8_E4M3 `weight` with a float32 `weight_scale` [out, 1];
  attention, the first and last layers and the LM head unchanged (`modules_to_not_convert`).
- `mxfp4`, as openai/gpt-oss-120b: each MoE layer's `experts.gate_up_proj` and `experts.down_proj`
  as `_blocks` U8 [experts, out, in/32, 16] (two e2m1 values a byte) and `_scales` U8 [experts, out,
  in/32] (e8m0 exponents), their biases unchanged; attention, router, embeddings and LM head unchanged.

`quantized_layout` gives the names, dtypes and shapes without any data, so real-width configs can be
checked against the published ones; `quantize_hf_checkpoint` writes a (tiny) checkpoint that way.
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from talaria_jax.models import quant

FORMATS = ("fp8-block", "fp8-channel", "mxfp4")
FP8_BLOCK = (128, 128)  # weight_block_size of every released block-FP8 checkpoint


def quantization_config(fmt: str, hf: dict, block: tuple[int, int] = FP8_BLOCK) -> dict:
    """config.json's `quantization_config` for `fmt`, with the keys and values the released checkpoints
    carry (Qwen3-235B-A22B-FP8, Llama-3.1-405B-Instruct-FP8, gpt-oss-120b)."""
    if fmt == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(block)}
    if fmt == "fp8-channel":
        n = hf["num_hidden_layers"]
        keep = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(n) for p in "qkvo"]
        keep += [f"model.layers.{i}.mlp.{p}_proj" for i in (0, n - 1) for p in ("gate", "up", "down")]
        return {"activation_scale_ub": 1200.0, "modules_to_not_convert": keep + ["lm_head"],
                "quant_method": "fbgemm_fp8"}
    if fmt == "mxfp4":
        return {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
    raise ValueError(f"format {fmt!r} not in {list(FORMATS)}")


def _fp8_targets(fmt: str, hf: dict, names: list[str]) -> list[str]:
    """The `...weight` tensors `fmt` stores in fp8."""
    n = hf["num_hidden_layers"]
    out = []
    for name in names:
        m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(.+)\.weight", name)
        if not m or not m.group(3).endswith("_proj"):  # norms, router (`mlp.gate`), embeddings, LM head
            continue
        if fmt == "fp8-channel" and (m.group(2) == "self_attn" or int(m.group(1)) in (0, n - 1)):
            continue
        out.append(name)
    return out


def quantized_layout(fmt: str, hf: dict, shapes: dict[str, tuple[int, ...]],
                     block: tuple[int, int] = FP8_BLOCK) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype, shape)} of the quantized tensors `fmt` writes for a checkpoint
    whose unquantized tensors have `shapes` (HF names) and whose config.json is `hf`; the tensors not
    listed are written as they are. Raises ValueError for a format that does not fit the model."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    if fmt in ("fp8-block", "fp8-channel"):
        for name in _fp8_targets(fmt, hf, list(shapes)):
            o, i = shapes[name]
            out[name] = ("F8_E4M3", (o, i))
            if fmt == "fp8-block":
                out[name.removesuffix("weight") + "weight_scale_inv"] = ("F32", (-(-o // block[0]), -(-i // block[1])))
            else:
                out[name.removesuffix("weight") + "weight_scale"] = ("F32", (o, 1))
        return out
    if fmt != "mxfp4":
        raise ValueError(f"format {fmt!r} not in {list(FORMATS)}")
    for name, shape in shapes.items():
        if not re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", name):
            continue
        x, i, o = shape  # HF's unquantized experts are [experts, in, out]
        if i % quant.MXFP4_BLOCK:
            raise ValueError(f"{name}: input dimension {i} is not a multiple of {quant.MXFP4_BLOCK}")
        g = i // quant.MXFP4_BLOCK
        out[f"{name}_blocks"] = ("U8", (x, o, g, quant.MXFP4_BLOCK // 2))
        out[f"{name}_scales"] = ("U8", (x, o, g))
    if not out:
        raise ValueError("mxfp4: the checkpoint has no fused experts (gpt-oss's mlp.experts.gate_up_proj)")
    return out


def quantize_hf_checkpoint(src: str | pathlib.Path, dst: str | pathlib.Path, fmt: str,
                           block: tuple[int, int] = FP8_BLOCK) -> pathlib.Path:
    """Writes the unquantized HF checkpoint `src` (config.json + safetensors) to `dst` in `fmt`
    (module docstring): the quantized tensors replace their originals, config.json gains the
    released checkpoints' `quantization_config`, every other file is copied."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} not in {list(FORMATS)}")
    hf = json.loads((src / "config.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    layout = quantized_layout(fmt, hf, {k: v.shape for k, v in tensors.items()}, block)
    out = dict(tensors)
    if fmt == "mxfp4":
        for name in {n.rsplit("_", 1)[0] for n in layout}:
            blocks, scales = quant.quantize_mxfp4(np.swapaxes(tensors[name].astype(np.float32), 1, 2))
            del out[name]
            out[f"{name}_blocks"] = blocks.reshape(layout[f"{name}_blocks"][1])
            out[f"{name}_scales"] = scales
    else:
        for name in [n for n, (dt, _) in layout.items() if dt == "F8_E4M3"]:
            w = tensors[name].astype(np.float32)
            values, scale = quant.quantize_fp8(w, block if fmt == "fp8-block" else (1, 0))
            out[name] = values
            out[name.removesuffix("weight") + ("weight_scale_inv" if fmt == "fp8-block" else "weight_scale")] = scale
    for name, (_, shape) in layout.items():
        assert out[name].shape == shape, (name, out[name].shape, shape)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(dict(hf, quantization_config=quantization_config(fmt, hf, block)),
                                                indent=2))
    return dst
