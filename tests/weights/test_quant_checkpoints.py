"""Quantized checkpoints as the released models ship them (FP8 with 128 x 128 block scales as
Qwen3-235B-A22B-FP8, FP8 per output channel as Llama-3.1-405B-FP8, MXFP4 experts as gpt-oss),
loaded sharded onto 1, TP=8 and EP x TP meshes and run in their own precision."""
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from talaria_jax.engine import Engine, EngineConfig, SamplingParams
from talaria_jax.models import load_model_config
from talaria_jax.models.model import abstract_model, dequantized, forward, greedy_generate
from talaria_jax.models.quant import QuantConfig, QuantError
from talaria_jax.sharding import make_mesh
from talaria_jax.sim.hardware import load_models
from talaria_jax.weights import CheckpointError, load_hf_checkpoint, restore
from talaria_jax.weights.hf_quantize import quantization_config, quantize_hf_checkpoint, quantized_layout
from talaria_jax.weights.slot import HostWeights, SlotLayout, WeightSlot, without_weights

ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets"
# config.json `quantization_config` of the released checkpoints (their Hugging Face repositories)
PUBLISHED = {
    "fp8-block": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                  "weight_block_size": [128, 128]},  # Qwen/Qwen3-235B-A22B-FP8
    "mxfp4": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                         "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},  # openai/gpt-oss-120b
}
# (format, source checkpoint, block): the block-FP8 checkpoint three times, at the released 128 x 128
# (one partial block per tiny matrix), at 16 x 32 (many blocks, several per shard) and at 48 x 48
# (a partial last block along each axis: 64 = 48 + 16 inputs, 8 heads = 3 + 3 + 2)
CASES = {"fp8-block": ("fp8-block", "hf-tiny-qwen3-moe", (128, 128)),
         "fp8-block-16x32": ("fp8-block", "hf-tiny-qwen3-moe", (16, 32)),
         "fp8-block-48x48": ("fp8-block", "hf-tiny-qwen3-moe", (48, 48)),
         "fp8-channel": ("fp8-channel", "llama-4-layers", (128, 128)),
         "mxfp4": ("mxfp4", "hf-tiny-gpt-oss", (128, 128))}
MESHES = {"1": dict(), "tp8": dict(tp=8), "ep2xtp4": dict(tp=4, ep=2)}


def _mesh(name):
    kw = MESHES[name]
    return make_mesh(jax.devices()[:1] if not kw else jax.devices(), **kw)


def _source(name: str, root: pathlib.Path) -> pathlib.Path:
    """An unquantized tiny checkpoint whose matrices vary in magnitude by row and column (so every
    block has its own scale, and a scale laid on the wrong block shows): a test asset, or a 4-layer
    Llama made from the 2-layer one (per-channel FP8 leaves the first and last layers alone)."""
    out = root / f"src-{name}"
    if out.exists():
        return out
    shutil.copytree(ASSETS / ("hf-tiny-llama" if name == "llama-4-layers" else name), out)
    tensors = load_file(out / "model.safetensors")
    if name == "llama-4-layers":
        cfg = json.loads((out / "config.json").read_text())
        for k in [k for k in tensors if k.startswith("model.layers.")]:
            i = int(k.split(".")[2])
            tensors[k.replace(f"layers.{i}.", f"layers.{i + 2}.", 1)] = tensors[k][::-1].copy()
        (out / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=4)))
    rng = np.random.default_rng(0)
    for k, v in tensors.items():
        if k.startswith("model.layers.") and v.ndim >= 2 and "norm" not in k:
            rows = np.exp(rng.normal(size=v.shape[-2]))[:, None]
            cols = np.exp(rng.normal(size=v.shape[-1]))[None, :]
            tensors[k] = (v * rows * cols / np.sqrt(np.e)).astype(v.dtype)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for case, (fmt, src, block) in CASES.items():
        source = _source(src, root)
        out[case] = (source, quantize_hf_checkpoint(source, root / case, fmt, block))
    return out


def test_quantization_config_is_the_released_one():
    for fmt, published in PUBLISHED.items():
        assert quantization_config(fmt, {}) == published
    llama = quantization_config("fp8-channel", {"num_hidden_layers": 126})
    assert llama["quant_method"] == "fbgemm_fp8"
    kept = set(llama["modules_to_not_convert"])
    assert {"model.layers.0.mlp.down_proj", "model.layers.125.mlp.gate_proj", "model.layers.64.self_attn.q_proj",
            "lm_head"} <= kept and "model.layers.64.mlp.down_proj" not in kept


def test_real_width_layouts_are_the_released_tensors():
    # Qwen3-235B-A22B-FP8's tensors (hidden 4096, 64 x 128 query, 4 x 128 kv, 128 experts of 1536)
    hf = {"num_hidden_layers": 94}
    shapes = {"model.embed_tokens.weight": (151936, 4096), "model.layers.0.mlp.gate.weight": (128, 4096),
              "model.layers.0.self_attn.q_proj.weight": (8192, 4096),
              "model.layers.0.self_attn.k_proj.weight": (512, 4096),
              "model.layers.0.self_attn.o_proj.weight": (4096, 8192),
              "model.layers.0.self_attn.q_norm.weight": (128,),
              "model.layers.0.mlp.experts.127.gate_proj.weight": (1536, 4096),
              "model.layers.0.mlp.experts.127.down_proj.weight": (4096, 1536)}
    got = quantized_layout("fp8-block", hf, shapes)
    a, e = "model.layers.0.self_attn", "model.layers.0.mlp.experts.127"
    assert got == {f"{a}.q_proj.weight": ("F8_E4M3", (8192, 4096)), f"{a}.q_proj.weight_scale_inv": ("F32", (64, 32)),
                   f"{a}.k_proj.weight": ("F8_E4M3", (512, 4096)), f"{a}.k_proj.weight_scale_inv": ("F32", (4, 32)),
                   f"{a}.o_proj.weight": ("F8_E4M3", (4096, 8192)), f"{a}.o_proj.weight_scale_inv": ("F32", (32, 64)),
                   f"{e}.gate_proj.weight": ("F8_E4M3", (1536, 4096)),
                   f"{e}.gate_proj.weight_scale_inv": ("F32", (12, 32)),
                   f"{e}.down_proj.weight": ("F8_E4M3", (4096, 1536)),
                   f"{e}.down_proj.weight_scale_inv": ("F32", (32, 12))}
    # gpt-oss-120b's experts: 128 x (2 x 2880) gate/up rows and 2880 down rows, 90 blocks of 32 inputs
    x = "model.layers.0.mlp.experts"
    got = quantized_layout("mxfp4", {}, {f"{x}.gate_up_proj": (128, 2880, 5760), f"{x}.down_proj": (128, 2880, 2880),
                                         f"{x}.gate_up_proj_bias": (128, 5760)})
    assert got == {f"{x}.gate_up_proj_blocks": ("U8", (128, 5760, 90, 16)), f"{x}.gate_up_proj_scales": ("U8", (128, 5760, 90)),
                   f"{x}.down_proj_blocks": ("U8", (128, 2880, 90, 16)), f"{x}.down_proj_scales": ("U8", (128, 2880, 90))}


@pytest.mark.parametrize("variant,config", [("qwen3-235b-a22b-fp8", "qwen3-235b-a22b"), ("glm-4.5-fp8", "glm-4.5"),
                                            ("gpt-oss-120b", "gpt-oss-120b"), ("llama-3.1-405b-fp8", "llama-3.1-405b")])
def test_simulator_bytes_are_the_loaded_arrays(variant, config):
    """The simulator's bytes per model (configs/hardware/models.yaml) are what the loaded arrays hold:
    a real-width cut of the model (its first layers, all of them at gpt-oss's alternation) built
    abstractly on an 8-device TP mesh, its stored bytes against the same arithmetic the profile uses,
    per model and per device."""
    shape = load_models()[variant]
    quant = {"qwen3-235b-a22b-fp8": QuantConfig("fp8", (128, 128)), "glm-4.5-fp8": QuantConfig("fp8", (128, 128)),
             "llama-3.1-405b-fp8": QuantConfig("fp8", (1, 0)),
             "gpt-oss-120b": None}[variant]
    full = load_model_config(config)
    full = full.replace(weight_dtype="bfloat16", quant=quant or full.quant)
    assert shape.weight_bytes == full.weight_bytes()
    layers = 2 if full.moe is None or full.moe.first_dense_layers == 0 else full.moe.first_dense_layers + 1
    cut = full.replace(num_layers=layers, dtype="bfloat16", sliding_windows=full.sliding_windows[:layers])
    _, abstract, shardings = abstract_model(cut, make_mesh(jax.devices(), tp=8))
    leaves = jax.tree.leaves(abstract)
    # equal but for GLM's score-correction biases, float32 where the arithmetic counts bf16 (640 B)
    assert sum(leaf.size * leaf.dtype.itemsize for leaf in leaves) == pytest.approx(cut.weight_bytes(), rel=1e-6)
    per_device = sum(int(np.prod(s.shard_shape(leaf.shape))) * leaf.dtype.itemsize
                     for leaf, s in zip(leaves, jax.tree.leaves(shardings)))
    # replicated pieces (norms, routers, fewer kv heads than ranks, scales whose blocks straddle shards)
    extra = per_device / (cut.weight_bytes() / 8) - 1
    assert 0 <= extra < (0.15 if variant == "gpt-oss-120b" else 0.02), extra


def _relative_error(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("case", sorted(CASES))
def test_dequantized_weights_are_the_source_within_the_format(case, checkpoints):
    src, ckpt = checkpoints[case]
    model = load_hf_checkpoint(ckpt, progress=False)
    plain = load_hf_checkpoint(src, progress=False).param_arrays()
    got = dequantized(model).param_arrays()
    quantized = [k.removesuffix("_scale") for k in model.param_arrays() if k.endswith("_scale")]
    assert quantized and got.keys() == plain.keys()
    bound = 0.2 if case == "mxfp4" else 0.05  # 1 mantissa bit against 3 (e2m1, e4m3)
    for k in quantized:
        err = _relative_error(got[k], np.asarray(plain[k]))
        assert 0 < err < bound, (k, err)
    for k in plain.keys() - set(quantized):  # stored as they were
        assert np.array_equal(np.asarray(got[k]), np.asarray(plain[k])), k


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_the_dequantized_reference(case, mesh, checkpoints):
    _, ckpt = checkpoints[case]
    prompts = json.loads((ASSETS / "hf-tiny-llama" / "prompts.json").read_text())
    model = load_hf_checkpoint(ckpt, _mesh(mesh), progress=False)
    ref = dequantized(model)
    tokens = np.asarray([prompts[2]])
    got, want = np.asarray(forward(model, tokens)), np.asarray(forward(ref, tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert greedy_generate(model, prompts, 8) == greedy_generate(ref, prompts, 8)


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_engine_runs_the_quantized_model(case, checkpoints):
    _, ckpt = checkpoints[case]
    prompts = json.loads((ASSETS / "hf-tiny-llama" / "prompts.json").read_text())
    model = load_hf_checkpoint(ckpt, _mesh("tp8"), progress=False)
    eng = Engine(model, EngineConfig(page_size=4, max_seqs=3, max_tokens_per_step=16, max_model_len=64, warmup=False))
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), progress=False)
    assert [o.token_ids for o in outs] == greedy_generate(dequantized(model), prompts, 12)


_ITEM = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1}


def _tensor_bytes(folder: pathlib.Path) -> int:
    """The bytes of a checkpoint's tensors, from the safetensors header."""
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) * _ITEM[f.get_slice(k).get_dtype()] for k in f.keys())


@pytest.mark.parametrize("case", sorted(CASES))
def test_device_memory_and_a_switch_are_the_checkpoints_bytes(case, checkpoints):
    _, ckpt = checkpoints[case]
    want = _tensor_bytes(ckpt)
    for mesh in ("1", "tp8"):
        model = load_hf_checkpoint(ckpt, _mesh(mesh), progress=False)
        held = sum(s.data.nbytes for a in model.param_arrays().values() for s in a.addressable_shards
                   if s.replica_id == 0)
        assert abs(held / want - 1) < 0.02, (mesh, held, want)
    # a switch through the weight slot copies the layout's bytes: the checkpoint's, scales included
    model = load_hf_checkpoint(ckpt, _mesh("1"), progress=False)
    host = HostWeights.of(model)
    slot = WeightSlot.for_layouts(model.mesh, [host.layout])
    slot.stage(host)
    slot.activate_staged()
    assert slot.h2d_bytes == slot.d2d_bytes == host.nbytes
    assert abs(host.nbytes / want - 1) < 0.02, (host.nbytes, want)
    prompts = json.loads((ASSETS / "hf-tiny-llama" / "prompts.json").read_text())[:1]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(page_size=8, max_seqs=1, max_tokens_per_step=8, max_model_len=32, warmup=False)
    eng = Engine(without_weights(model), cfg)
    eng.runner.use_slot(slot, SlotLayout.of(model, word=slot.word))
    own = Engine(model, cfg)
    assert [o.token_ids for o in eng.generate(prompts, greedy, progress=False)] == \
        [o.token_ids for o in own.generate(prompts, greedy, progress=False)]


def test_orbax_and_talaria_convert_keep_the_quantized_bytes(checkpoints, tmp_path):
    _, ckpt = checkpoints["mxfp4"]
    out = tmp_path / "orbax"
    subprocess.run([sys.executable, "-m", "talaria_jax.launch.convert", f"--model={ckpt}", f"--out={out}"],
                   check=True, timeout=300, capture_output=True)
    src = load_hf_checkpoint(ckpt, _mesh("tp8"), progress=False)
    back = restore(out, _mesh("ep2xtp4"))
    assert back.cfg.quant == src.cfg.quant and back.cfg.quant.method == "mxfp4"
    a, b = src.param_arrays(), back.param_arrays()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.asarray(a[k]).view(np.uint8),
                                                           np.asarray(b[k]).view(np.uint8)), k


@pytest.mark.hf
def test_mxfp4_dequantizes_as_transformers_does(checkpoints):
    # transformers' own conversion of gpt-oss's packed experts (dequantize-then-compute reference)
    torch = pytest.importorskip("torch")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    _, ckpt = checkpoints["mxfp4"]
    x = "model.layers.1.mlp.experts"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        gate_up = mxfp4.convert_moe_packed_tensors(f.get_tensor(f"{x}.gate_up_proj_blocks"),
                                                   f.get_tensor(f"{x}.gate_up_proj_scales"), dtype=torch.float32)
        down = mxfp4.convert_moe_packed_tensors(f.get_tensor(f"{x}.down_proj_blocks"),
                                                f.get_tensor(f"{x}.down_proj_scales"), dtype=torch.float32)
    ours = dequantized(load_hf_checkpoint(ckpt, progress=False)).param_arrays()
    np.testing.assert_array_equal(np.asarray(ours["blocks.1.ffn.gate_proj"]), gate_up.numpy()[..., 0::2])
    np.testing.assert_array_equal(np.asarray(ours["blocks.1.ffn.up_proj"]), gate_up.numpy()[..., 1::2])
    np.testing.assert_array_equal(np.asarray(ours["blocks.1.ffn.down_proj"]), down.numpy())


def _copy(ckpt: pathlib.Path, dst: pathlib.Path) -> dict:
    """A copy of the checkpoint `ckpt` at `dst`; returns its config.json."""
    shutil.copytree(ckpt, dst)
    return json.loads((dst / "config.json").read_text())


def _set_quantization_config(dst: pathlib.Path, cfg: dict, qc: dict) -> None:
    (dst / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc)))


def test_scales_of_another_block_size_are_refused_by_name(checkpoints, tmp_path):
    _, ckpt = checkpoints["fp8-block-16x32"]
    d = tmp_path / "other-blocks"
    cfg = _copy(ckpt, d)  # the same count of scales, other blocks:
    _set_quantization_config(d, cfg, dict(cfg["quantization_config"], weight_block_size=[32, 16]))
    with pytest.raises(CheckpointError, match=r"^blocks\.0\.attn\.k_proj_scale: the checkpoint's scales are \(4, 2\); "
                                              r"a \[64, 64\] matrix in blocks of \(32, 16\) \(out, in\) has \(2, 4\)$"):
        load_hf_checkpoint(d, progress=False)


def test_compressed_tensors_channel_fp8_reads_as_fbgemm(checkpoints, tmp_path):
    # RedHatAI's FP8 checkpoints: the same per-channel tensors under compressed-tensors' config
    _, ckpt = checkpoints["fp8-channel"]
    d = tmp_path / "ct"
    cfg = _copy(ckpt, d)
    weights = {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": "channel", "symmetric": True,
               "type": "float"}
    qc = {"config_groups": {"group_0": {"input_activations": {"dynamic": True, "num_bits": 8, "strategy": "token",
                                                              "symmetric": True, "type": "float"},
                                        "output_activations": None, "targets": ["Linear"], "weights": weights}},
          "format": "float-quantized", "ignore": ["lm_head"], "quant_method": "compressed-tensors",
          "quantization_status": "compressed"}
    _set_quantization_config(d, cfg, qc)
    a, b = load_hf_checkpoint(ckpt, progress=False), load_hf_checkpoint(d, progress=False)
    assert a.cfg.quant == b.cfg.quant == QuantConfig("fp8", (1, 0), a.cfg.quant.exclude)
    assert all(np.array_equal(np.asarray(x), np.asarray(b.param_arrays()[k])) for k, x in a.param_arrays().items())
    _set_quantization_config(d, cfg, dict(qc, config_groups={"group_0": {"weights": dict(weights, num_bits=4,
                                                                                          type="int")}}))
    with pytest.raises(CheckpointError, match="one group of 8-bit float weights"):
        load_hf_checkpoint(d, progress=False)


def test_bad_quantized_checkpoints_are_refused_by_name(checkpoints, tmp_path):
    _, ckpt = checkpoints["fp8-block"]
    d = tmp_path / "bad"
    cfg = _copy(ckpt, d)
    for qc, match in ((dict(quant_method="gptq"), r"quant_method 'gptq' is not supported; supported: \['fp8'"),
                      (dict(cfg["quantization_config"], fmt="e5m2"), "fmt='e5m2'")):
        _set_quantization_config(d, cfg, qc)
        with pytest.raises(CheckpointError, match=match):
            load_hf_checkpoint(d, progress=False)
    (d / "config.json").write_text(json.dumps(cfg))
    with safe_open(str(ckpt / "model.safetensors"), framework="numpy") as f:
        plain = {k: f.get_tensor(k) for k in f.keys() if f.get_slice(k).get_dtype() != "F8_E4M3"}
    save_file(plain, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="no weight is stored quantized"):  # the fp8 tensors are gone
        load_hf_checkpoint(d, progress=False)
    with pytest.raises(QuantError, match=r"blocks\.0\.attn\.q_proj: a block of 48 elements does not tile"):
        abstract_model(load_model_config("tiny-dense").replace(quant=QuantConfig("fp8", (48, 128))),
                       _mesh("1"))
