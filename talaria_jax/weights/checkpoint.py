"""Orbax save/restore of a model's parameters, restoring onto any mesh (target shardings)."""
from __future__ import annotations

import json
import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from talaria_jax import config_io
from talaria_jax.models.config import ModelConfig, with_default_compute_dtype
from talaria_jax.models.model import ShardedModel, abstract_model, weights_fingerprint
from talaria_jax.sharding import make_mesh, mesh_platform

CONFIG_FILE = "talaria_model_config.json"
_WEIGHTS_FILE = "talaria_weights.json"  # the weights fingerprint, so restored KV and caches stay keyed to it


def save(model: ShardedModel, path: str | pathlib.Path, tokenizer=None) -> pathlib.Path:
    """Writes params (Orbax, sharded, each host writes its shards) and the model config beside them,
    and the tokenizer (`tokenizer.save(folder)`), so `load_tokenizer(path)` finds it."""
    path = pathlib.Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", nnx.to_pure_dict(model.state))
    (path / CONFIG_FILE).write_text(json.dumps(config_io.to_dict(model.cfg), indent=1))
    (path / _WEIGHTS_FILE).write_text(json.dumps({"fingerprint": model.fingerprint}))
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def load_config(path: str | pathlib.Path) -> ModelConfig:
    return config_io.from_dict(ModelConfig, json.loads((pathlib.Path(path) / CONFIG_FILE).read_text()))


def restore(path: str | pathlib.Path, mesh: Mesh | None = None, cfg: ModelConfig | None = None,
            dtype: str | None = None) -> ShardedModel:
    """Restores onto `mesh` (any shape; default one device): every array is read straight into the
    target sharding that the rules table gives for this mesh, cast to `dtype` (default: the saved one;
    on a GPU or TPU bfloat16 where that is float32, `default_compute_dtype`)."""
    path = pathlib.Path(path).absolute()
    saved = load_config(path)
    saved_dtype, cfg = saved.dtype, cfg or saved
    mesh = mesh or make_mesh(jax.devices()[:1])
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype, weight_dtype=dtype, kv_dtype=dtype)
    else:
        cfg = with_default_compute_dtype(cfg, mesh_platform(mesh))
        dtype = cfg.dtype
    graphdef, abstract, shardings = abstract_model(cfg, mesh)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(abstract), nnx.to_pure_dict(shardings))
    with ocp.StandardCheckpointer() as ckptr:
        pure = ckptr.restore(path / "params", target)
    state = abstract
    nnx.replace_by_pure_dict(state, pure)
    meta = path / _WEIGHTS_FILE
    fingerprint = json.loads(meta.read_text())["fingerprint"] if meta.exists() else weights_fingerprint("orbax", str(path))
    if cfg.dtype != saved_dtype:  # other compute dtype: other numbers, so other KV
        fingerprint = weights_fingerprint(fingerprint, dtype)
    return ShardedModel(cfg, mesh, graphdef, state, fingerprint)
