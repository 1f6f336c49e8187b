"""One table from logical parameter roles to mesh axes, and the shardings it implies.

Parameters name their role (`axes=("embed", "heads", "head_dim")`); this module alone decides
which mesh axis carries it. A dimension that the mesh axis does not divide is replicated, which is
how kv heads stay whole when kv_heads < tp (Qwen3-235B at TP=8: 4 kv heads on 8 ranks). That costs
memory on every device, so `state_shardings` logs, once per model, what it replicated and the cost.
"""
from __future__ import annotations

import collections
import math
import re
from typing import Any

import jax
import numpy as np
from absl import logging
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
    return _spec_and_undivided(axes, shape, mesh, rules)[0]


def _spec_and_undivided(axes, shape, mesh, rules=LOGICAL_RULES) -> tuple[P, list[tuple[str, int, str, int]]]:
    """The PartitionSpec, and (logical axis, dim, mesh axis, its size) of each dim left replicated
    because the mesh axis does not divide it."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    out, used, undivided = [], set(), []
    for name, dim in zip(axes, shape):
        if name not in rules:
            raise KeyError(f"no sharding rule for logical axis {name!r}; known: {sorted(k for k in rules if k)}")
        axis = rules[name]
        size = mesh.shape.get(axis, 1) if axis else 1
        if axis is None or size == 1 or dim % size or axis in used:
            out.append(None)
            if axis is not None and size > 1 and dim % size and axis not in used:
                undivided.append((name, dim, axis, size))
        else:
            out.append(axis)
            used.add(axis)
    return P(*out), undivided


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """NamedShardings with the same tree structure as an nnx State (abstract or concrete). Parameters
    a mesh axis does not divide are replicated, and a WARNING says which and what it costs per device
    (once per model and mesh in a process, however often this is called)."""

    def one(var):
        axes = var.get_metadata().get("axes")
        shape = var.get_value().shape
        spec = spec_for(axes, shape, mesh) if axes is not None else P()
        return var.replace(NamedSharding(mesh, spec))

    shardings = jax.tree.map(one, state, is_leaf=_is_var)
    message = replication_report(state, mesh)
    # a model is known by its parameter names and shapes: logged once each, however often sharded
    model = tuple((jax.tree_util.keystr(p), v.get_value().shape)
                  for p, v in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)[0] if _is_var(v))
    if message and (message, model) not in _REPORTED:
        _REPORTED.add((message, model))
        # WARNING, not INFO: it is memory every device pays (capacity planning, the KV budget), and
        # INFO is hidden by default outside absl.app programs, which would leave it silent again.
        logging.warning("%s", message)
    return shardings


_REPORTED: set[tuple] = set()  # (report, model) pairs already logged in this process


def replication_report(state: Any, mesh: Mesh) -> str:
    """One line per reason a mesh axis does not divide a parameter dim: the parameters replicated for
    it (layer indices folded to *) and the bytes per device that costs over an even split; "" if none."""
    groups: dict[tuple, list] = collections.defaultdict(lambda: [set(), 0])
    for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)[0]:
        axes = var.get_metadata().get("axes") if _is_var(var) else None
        if axes is None:
            continue
        value = var.get_value()
        spec, undivided = _spec_and_undivided(axes, value.shape, mesh)
        if not undivided:
            continue
        per_device = math.prod(value.shape) * np.dtype(value.dtype).itemsize
        for a in spec:
            per_device //= mesh.shape[a] if a else 1
        for why in undivided:
            g = groups[why]
            g[0].add(re.sub(r"\.\d+(?=\.|$)", ".*", ".".join(_key(k) for k in path)))
            g[1] += per_device - per_device // why[3]  # held whole instead of 1/size of it
    lines = [f"{name} {dim} not divisible by {axis}={size}: {', '.join(sorted(params))} replicated, "
             f"+{extra / 2**20:.2f} MiB per device" for (name, dim, axis, size), (params, extra) in groups.items()]
    return f"sharding on mesh {dict(mesh.shape)}: " + "; ".join(lines) if lines else ""


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
