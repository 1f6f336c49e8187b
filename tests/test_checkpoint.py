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

ASSETS = pathlib.Path(__file__).parent / "assets"


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
