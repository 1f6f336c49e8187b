"""Orbax save/restore of a model's parameters, restoring onto any mesh (target shardings)."""
from __future__ import annotations

import json
import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from talaria_jax import config_io
from talaria_jax.models.config import ModelConfig
from talaria_jax.models.model import ShardedModel, abstract_model
from talaria_jax.sharding import make_mesh

_CONFIG_FILE = "talaria_model_config.json"


def save(model: ShardedModel, path: str | pathlib.Path) -> pathlib.Path:
    """Writes params (Orbax, sharded, each host writes its shards) and the model config beside them."""
    path = pathlib.Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", nnx.to_pure_dict(model.state))
    (path / _CONFIG_FILE).write_text(json.dumps(config_io.to_dict(model.cfg), indent=1))
    return path


def load_config(path: str | pathlib.Path) -> ModelConfig:
    return config_io.from_dict(ModelConfig, json.loads((pathlib.Path(path) / _CONFIG_FILE).read_text()))


def restore(path: str | pathlib.Path, mesh: Mesh | None = None, cfg: ModelConfig | None = None) -> ShardedModel:
    """Restores onto `mesh` (any shape; default one device): every array is read straight into the
    target sharding that the rules table gives for this mesh."""
    path = pathlib.Path(path).absolute()
    cfg = cfg or load_config(path)
    mesh = mesh or make_mesh(jax.devices()[:1])
    graphdef, abstract, shardings = abstract_model(cfg, mesh)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(abstract), nnx.to_pure_dict(shardings))
    with ocp.StandardCheckpointer() as ckptr:
        pure = ckptr.restore(path / "params", target)
    state = abstract
    nnx.replace_by_pure_dict(state, pure)
    return ShardedModel(cfg, mesh, graphdef, state)
