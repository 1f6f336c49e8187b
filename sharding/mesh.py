"""Mesh construction over any list of devices, with an expert-parallel and a tensor-parallel axis.

Two instances can split one server: `make_mesh(jax.devices()[:4], tp=4)` and
`make_mesh(jax.devices()[4:], tp=4)` are independent meshes.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

EP, TP = "ep", "tp"
AXES = (EP, TP)


def make_mesh(devices: Sequence[jax.Device] | None = None, tp: int | None = None, ep: int = 1) -> Mesh:
    """A (ep, tp) mesh over `devices` (default: all). tp defaults to len(devices) // ep."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: devices is empty")
    if ep < 1:
        raise ValueError(f"make_mesh: ep must be >= 1, got {ep}")
    tp = len(devices) // ep if tp is None else tp
    if tp < 1 or tp * ep != len(devices):
        raise ValueError(f"make_mesh: tp ({tp}) x ep ({ep}) must equal the number of devices ({len(devices)})")
    grid = np.asarray(devices, dtype=object).reshape(ep, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))



def mesh_platform(mesh: Mesh) -> str:
    """The platform of the mesh's devices: "cpu", "gpu" or "tpu" (a mesh never mixes them)."""
    return mesh.devices.flat[0].platform


def simulate_cpu_devices(n: int) -> None:
    """On the CPU backend, at least `n` (and 8) simulated devices, one per instance rank, unless XLA_FLAGS
    already sets a count. Call it before anything touches a device (the count is read once)."""
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={max(n, 8)}".strip()
