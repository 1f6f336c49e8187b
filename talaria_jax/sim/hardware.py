"""Hardware and model-shape configs for the simulator: YAML files loaded into frozen dataclasses.

Every field must be present, numeric and inside its limits; a bad file raises ``ConfigError``
naming the file, the field and the limit.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

import yaml

CONFIG_ROOT = pathlib.Path(__file__).resolve().parents[2] / "configs"
GB = 1e9
GIB = 2**30


class ConfigError(ValueError):
    """A config file or value is malformed; the message names the field and the limit."""


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
    """One server running one TP instance (see configs/hardware/*.yaml for the cited sources)."""

    name: str
    num_gpus: int
    hbm_gib_per_gpu: float
    memory_utilization: float
    hbm_bw_gbps: float
    hbm_bw_efficiency: float
    matmul_tflops: float
    prefill_efficiency: float
    nvlink_gbps: float
    allreduce_latency_us: float
    pcie_h2d_gbps: float
    pcie_d2h_gbps: float
    weight_load_efficiency: float
    d2d_gbps: float
    host_memory_gb: float
    host_reserve_gb: float

    @property
    def usable_hbm_bytes(self) -> float:
        """HBM the instance may fill with weights, staging and KV, summed over its GPUs."""
        return self.num_gpus * self.hbm_gib_per_gpu * GIB * self.memory_utilization

    @property
    def host_kv_bytes_budget(self) -> float:
        return (self.host_memory_gb - self.host_reserve_gb) * GB


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about one model variant (configs/hardware/models.yaml)."""

    name: str
    weights_gb: float
    active_params_b: float
    layers: int
    full_attn_layers: int
    kv_bytes_per_token: int
    attn_dim: int
    hidden: int
    num_experts: int
    top_k: int
    expert_fraction: float

    @property
    def weight_bytes(self) -> float:
        return self.weights_gb * GB


# (field, lower bound, upper bound); bounds are sanity limits, not physics.
_HW_LIMITS: dict[str, tuple[float, float]] = {
    "num_gpus": (1, 1024), "hbm_gib_per_gpu": (1, 4096), "memory_utilization": (0.05, 1.0),
    "hbm_bw_gbps": (1, 1e5), "hbm_bw_efficiency": (0.01, 1.0), "matmul_tflops": (0.001, 1e5),
    "prefill_efficiency": (0.01, 1.0), "nvlink_gbps": (0.1, 1e5), "allreduce_latency_us": (0, 1e5),
    "pcie_h2d_gbps": (0.1, 1e4), "pcie_d2h_gbps": (0.1, 1e4), "weight_load_efficiency": (0.01, 1.0),
    "d2d_gbps": (1, 1e5), "host_memory_gb": (1, 1e6), "host_reserve_gb": (0, 1e6),
}
_MODEL_LIMITS: dict[str, tuple[float, float]] = {
    "weights_gb": (0.001, 1e5), "active_params_b": (0.001, 1e5), "layers": (1, 1000),
    "full_attn_layers": (0, 1000), "kv_bytes_per_token": (1, 1e8), "attn_dim": (1, 1e6),
    "hidden": (1, 1e6), "num_experts": (0, 1e5), "top_k": (0, 1e5), "expert_fraction": (0.0, 1.0),
}


def _checked(kind: str, where: str, raw: Any, cls: type, limits: dict[str, tuple[float, float]],
             extra: dict[str, Any]) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {kind} must be a mapping, got {type(raw).__name__}")
    values: dict[str, Any] = dict(extra)
    for f in dataclasses.fields(cls):
        if f.name in values:
            continue
        if f.name not in raw:
            raise ConfigError(f"{where}: missing field '{f.name}'")
        v = raw[f.name]
        lo, hi = limits[f.name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{where}: field '{f.name}' must be a finite number, got {v!r}")
        if not lo <= v <= hi:
            raise ConfigError(f"{where}: field '{f.name}'={v} outside [{lo}, {hi}]")
        values[f.name] = int(v) if f.type in ("int", int) else float(v)
    return cls(**values)


def _resolve(path: str | pathlib.Path, subdir: str) -> pathlib.Path:
    p = pathlib.Path(path)
    if not p.suffix:  # a bare name like "h200x8" means configs/hardware/h200x8.yaml
        p = CONFIG_ROOT / subdir / f"{p}.yaml"
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    return p


def load_hardware(path: str | pathlib.Path) -> HardwareConfig:
    """Loads a hardware YAML (a path, or a name under configs/hardware/)."""
    p = _resolve(path, "hardware")
    raw = yaml.safe_load(p.read_text())
    name = raw.get("name", p.stem) if isinstance(raw, dict) else p.stem
    return _checked("hardware", str(p), raw, HardwareConfig, _HW_LIMITS, {"name": str(name)})


def load_models(path: str | pathlib.Path = CONFIG_ROOT / "hardware" / "models.yaml") -> dict[str, ModelShape]:
    """Loads the model-shape table; keys are the model names used in traces."""
    p = _resolve(path, "hardware")
    raw = yaml.safe_load(p.read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict):
        raise ConfigError(f"{p}: top-level field 'models' must be a mapping")
    out = {}
    for name, entry in raw["models"].items():
        shape = _checked("model", f"{p}: models.{name}", entry, ModelShape, _MODEL_LIMITS, {"name": str(name)})
        if shape.full_attn_layers > shape.layers:
            raise ConfigError(f"{p}: models.{name}: 'full_attn_layers' must be <= layers={shape.layers}")
        if shape.top_k > shape.num_experts:
            raise ConfigError(f"{p}: models.{name}: 'top_k' must be <= num_experts={shape.num_experts}")
        out[str(name)] = shape
    return out
