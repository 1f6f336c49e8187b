"""One table from logical parameter roles to mesh axes, and the shardings it implies.

Parameters name their role (`axes=("embed", "heads", "head_dim")`); this module alone decides
which mesh axis carries it. A dimension that the mesh axis does not divide is replicated, which is
how kv heads stay whole when kv_heads < tp (Qwen3-235B at TP=8: 4 kv heads on 8 ranks).
"""
from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from talaria_jax.sharding.mesh import EP, TP

# Logical role -> mesh axis (None: replicated).
LOGICAL_RULES: dict[str | None, str | None] = {
    "vocab": TP,
    "embed": None,
    "heads": TP,
    "kv_heads": TP,
    "head_dim": None,
    "mlp": TP,
    "experts": EP,
    "expert_mlp": TP,
    # KV pool pages (engine): pages and slots stay whole on every rank.
    "pages": None,
    "page_slots": None,
    None: None,
}


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
             rules: dict[str | None, str | None] = LOGICAL_RULES) -> P:
    """PartitionSpec for one array from its logical axes; non-dividing dims are replicated."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    out, used = [], set()
    for name, dim in zip(axes, shape):
        if name not in rules:
            raise KeyError(f"no sharding rule for logical axis {name!r}; known: {sorted(k for k in rules if k)}")
        axis = rules[name]
        size = mesh.shape.get(axis, 1) if axis else 1
        if axis is None or size == 1 or dim % size or axis in used:
            out.append(None)
        else:
            out.append(axis)
            used.add(axis)
    return P(*out)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """NamedShardings with the same tree structure as an nnx State (abstract or concrete)."""

    def one(var):
        axes = var.get_metadata().get("axes")
        shape = var.get_value().shape
        spec = spec_for(axes, shape, mesh) if axes is not None else P()
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=_is_var)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
