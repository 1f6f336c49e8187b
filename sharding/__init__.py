"""Meshes and partition rules (installed as talaria_jax.sharding)."""
from talaria_jax.sharding.mesh import AXES, EP, TP, make_mesh, mesh_platform, simulate_cpu_devices
from talaria_jax.sharding.rules import LOGICAL_RULES, replicated, spec_for, state_shardings

__all__ = ["AXES", "EP", "TP", "LOGICAL_RULES", "make_mesh", "mesh_platform", "replicated", "simulate_cpu_devices",
           "spec_for", "state_shardings"]
