"""Orbax save on one mesh / restore on another, and shape errors from HF checkpoints."""
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from talaria_jax.models import init_model, load_model_config
from talaria_jax.sharding import make_mesh
from talaria_jax.weights import CheckpointError, load_hf_checkpoint, restore, save

ASSETS = pathlib.Path(__file__).resolve().parents[1] / "assets"


def test_orbax_restore_onto_other_mesh_is_bit_identical(tmp_path):
    cfg = load_model_config("tiny-moe")
    src = init_model(cfg, make_mesh(jax.devices(), tp=8), seed=11)
    save(src, tmp_path / "ckpt")
    dst_mesh = make_mesh(jax.devices()[4:], tp=2, ep=2)
    dst = restore(tmp_path / "ckpt", dst_mesh)
    assert dst.cfg == cfg
    a, b = src.param_arrays(), dst.param_arrays()
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
        assert b[k].sharding.mesh == dst_mesh
    assert b["blocks.1.ffn.gate_proj"].sharding.spec == P("ep", None, "tp")


def test_shape_mismatch_names_parameter_and_shapes(tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(ASSETS / "hf-tiny-qwen3", d)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = np.zeros((96, 64), np.float32)  # config says intermediate_size 128
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(96, 64\).*\(64, 128\)"):
        load_hf_checkpoint(d, progress=False)


def test_config_mismatch_and_missing_tensor(tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(ASSETS / "hf-tiny-llama", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, hidden_size=96)))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*\(64, 64\).*config expects \(96, 4, 16\)"):
        load_hf_checkpoint(d, progress=False)
    (d / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2"):
        load_hf_checkpoint(d, progress=False)
    (d / "config.json").write_text(json.dumps(dict(cfg, model_type="mamba")))
    with pytest.raises(CheckpointError, match="model_type 'mamba' is not supported"):
        load_hf_checkpoint(d, progress=False)


def _copy(name: str, dst: pathlib.Path, **config_changes) -> pathlib.Path:
    """A copy of an HF test asset with config.json keys changed (None removes the key)."""
    shutil.copytree(ASSETS / name, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


def _logits(model) -> np.ndarray:
    from talaria_jax.models.model import forward

    return np.asarray(forward(model, np.array([[5, 300, 17, 42, 8, 99, 511, 3]], np.int32)))


def test_norm_topk_prob_defaults_follow_hf(tmp_path):
    """Without the key, Qwen3-MoE routes without renormalising (Qwen3MoeConfig's default False) and
    GLM-4.5 with it (Glm4MoeConfig's default True)."""
    absent = load_hf_checkpoint(_copy("hf-tiny-qwen3-moe", tmp_path / "a", norm_topk_prob=None), progress=False)
    false = load_hf_checkpoint(_copy("hf-tiny-qwen3-moe", tmp_path / "f", norm_topk_prob=False), progress=False)
    true = load_hf_checkpoint(ASSETS / "hf-tiny-qwen3-moe", progress=False)
    assert absent.cfg.moe.norm_topk_prob is False
    np.testing.assert_array_equal(_logits(absent), _logits(false))
    assert np.abs(_logits(absent) - _logits(true)).max() > 1e-3  # the flag changes the outputs of this model
    glm = load_hf_checkpoint(_copy("hf-tiny-glm4-moe", tmp_path / "g", norm_topk_prob=None), progress=False)
    assert glm.cfg.moe.norm_topk_prob is True


@pytest.mark.hf
def test_norm_topk_prob_defaults_are_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    from talaria_jax.weights.hf import _NORM_TOPK_DEFAULT

    assert _NORM_TOPK_DEFAULT == {"qwen3_moe": transformers.Qwen3MoeConfig().norm_topk_prob,
                                  "glm4_moe": transformers.Glm4MoeConfig().norm_topk_prob}


def test_missing_required_key_names_key_and_file(tmp_path):
    d = _copy("hf-tiny-qwen3", tmp_path / "m", num_attention_heads=None)
    with pytest.raises(CheckpointError, match=r"config\.json: required key 'num_attention_heads' is missing"):
        load_hf_checkpoint(d, progress=False)
    d = _copy("hf-tiny-qwen3-moe", tmp_path / "moe", moe_intermediate_size=None)
    with pytest.raises(CheckpointError, match=r"moe[/\\]config\.json: required key 'moe_intermediate_size'"):
        load_hf_checkpoint(d, progress=False)


def test_bf16_checkpoint_keeps_its_dtype(tmp_path):
    import ml_dtypes

    d = _copy("hf-tiny-llama", tmp_path / "bf16", dtype="bfloat16")
    tensors = load_file(d / "model.safetensors")
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, d / "model.safetensors")
    model = load_hf_checkpoint(d, progress=False)
    assert model.cfg.dtype == "bfloat16"
    assert model.param_arrays()["blocks.0.attn.q_proj"].dtype == np.dtype(ml_dtypes.bfloat16)
    # Without a dtype in config.json the tensors decide; an explicit dtype wins.
    _copy("hf-tiny-llama", tmp_path / "nokey", dtype=None)
    shutil.copy(d / "model.safetensors", tmp_path / "nokey" / "model.safetensors")
    assert load_hf_checkpoint(tmp_path / "nokey", progress=False).cfg.dtype == "bfloat16"
    f32 = load_hf_checkpoint(d, dtype="float32", progress=False)
    assert f32.param_arrays()["blocks.0.attn.q_proj"].dtype == np.float32
    assert load_hf_checkpoint(ASSETS / "hf-tiny-llama", progress=False).cfg.dtype == "float32"
    bad = _copy("hf-tiny-llama", tmp_path / "fp8", dtype="float8_e4m3fn")
    with pytest.raises(CheckpointError, match=r"dtype 'float8_e4m3fn' is not a compute dtype"):
        load_hf_checkpoint(bad, progress=False)


def test_hf_fingerprint_follows_weights_and_dtype(tmp_path):
    a = load_hf_checkpoint(ASSETS / "hf-tiny-qwen3", progress=False)
    assert a.fingerprint and a.fingerprint == load_hf_checkpoint(ASSETS / "hf-tiny-qwen3", progress=False).fingerprint
    d = _copy("hf-tiny-qwen3", tmp_path / "same")  # another folder, same content: same weights
    assert load_hf_checkpoint(d, progress=False).fingerprint == a.fingerprint
    assert load_hf_checkpoint(d, dtype="bfloat16", progress=False).fingerprint != a.fingerprint
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] += 1.0  # one weight changed, same shapes
    save_file(tensors, d / "model.safetensors")
    assert load_hf_checkpoint(d, progress=False).fingerprint != a.fingerprint
