"""The cluster simulator: roofline cost model, ``SimInstance`` (an ``InstanceAPI`` over a virtual
clock), SWE-bench-style trace generator and the discrete-event replay. No JAX, no engine code."""
from talaria_jax.sim.bounds import sct_floor_s, service_floor_s
from talaria_jax.sim.cluster import ReplayResult, replay
from talaria_jax.sim.cost import CostModel
from talaria_jax.sim.hardware import ConfigError, HardwareConfig, ModelShape, load_hardware, load_models
from talaria_jax.sim.instance import CapacityError, SimInstance
from talaria_jax.sim.traces import TraceError, TraceSpec, generate, parse_jsonl, read_jsonl, write_jsonl

__all__ = ["sct_floor_s", "service_floor_s", "ReplayResult", "replay", "CostModel", "ConfigError", "HardwareConfig", "ModelShape", "load_hardware",
           "load_models", "CapacityError", "SimInstance", "TraceError", "TraceSpec", "generate", "parse_jsonl",
           "read_jsonl", "write_jsonl"]
