"""Hardware and model-shape configs for the simulator.

A hardware YAML loads into a frozen ``HardwareConfig``: every field must be present, numeric and
inside its limits. Model shapes are not written here: configs/hardware/models.yaml lists served
variants (a model config and a weight precision) and ``ModelShape.from_config`` derives each shape
from its ``ModelConfig`` (configs/models/). A bad file raises ``ConfigError`` naming the file, the
field and the limit.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, Iterable

import yaml

from talaria_jax import config_io
from talaria_jax.config_io import ConfigError
from talaria_jax.models.config import ModelConfig, available_models, bytes_per_weight, load_model_config
from talaria_jax.models.quant import QuantConfig

GB = 1e9
GIB = 2**30


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
    step_overhead_us: float  # fixed cost of one engine step or prefill (launch, host scheduling, sampling)
    pcie_h2d_gbps: float
    pcie_d2h_gbps: float
    weight_load_efficiency: float
    d2d_gbps: float
    host_memory_gb: float
    host_reserve_gb: float
    # factor by which an engine step's time grows while a staging copy (the next model's weights,
    # host to device) is in flight on the same device(s): 1.0 when the copy overlaps for free, as a
    # GPU's copy engine over PCIe does while compute reads HBM; above 1 on a CPU, where the copy takes
    # the step's cores and memory bandwidth (talaria-calibrate measures it)
    staging_step_slowdown: float = 1.0
    # factor by which an engine step's time grows while another replica's engine on the same host
    # steps at once: 1.0 where each replica owns its devices (GPUs); near 2 on a CPU whose cores the
    # replicas share (talaria-calibrate --engine=rollout measures it; rollout/replay.py's
    # replicas_per_host uses it)
    colocated_step_slowdown: float = 1.0
    # share of the weights' read rate that attention's reads of the KV cache get (paged gathers): 1.0
    # where both stream at the HBM rate; below 1 on a CPU (talaria-calibrate fits it when its points
    # span enough context)
    kv_bw_efficiency: float = 1.0
    # share of the matmul rate that prefill attention's FLOPs (a chunk's queries against its cached
    # context and itself) get: 1.0 where an attention kernel runs them at the matmul rate; below 1 on a
    # CPU's reference attention (talaria-calibrate --engine=rollout fits it from prefill steps after a
    # cached context). Decode attention is bound by its KV reads (kv_bw_efficiency)
    attention_efficiency: float = 1.0
    # how far a step's compute and memory traffic overlap: 1.0, a step takes the longer of the two (the
    # roofline: a GPU's tensor cores compute while HBM streams); 0.0, their sum (a CPU's cores do both);
    # talaria-calibrate keeps whichever fits its points better (with a runner's tiles: their sum)
    compute_memory_overlap: float = 1.0
    # what each token of a step that verifies drafts takes beyond a prefill token's FLOPs and bytes (its
    # logits, the draft tree's mask, acceptance): talaria-calibrate --engine=rollout measures it; not
    # measured on GPUs (0)
    verify_token_overhead_us: float = 0.0
    # with a runner's tiles (`CostModel.tiles`: the jnp reference attention's layout, priced by the CPU
    # rollout replay), the rate of each query tile's walk over the keys it visits, block by block, as a
    # share of the weights' read rate; the step's KV itself is read once, at kv_bw_efficiency. Above 1
    # where the walks read mostly from cache (the tiles of one sequence walk the same pages);
    # talaria-calibrate --engine=rollout fits it; unused without tiles
    tile_walk_efficiency: float = 1.0

    def __post_init__(self) -> None:
        for field, what in (("staging_step_slowdown", "a step's time while a staging copy is in flight over its "
                             "time without; 1.0: the copy overlaps for free"),
                            ("colocated_step_slowdown", "a step's time while another replica of the host steps "
                             "over its time alone; 1.0: replicas share nothing")):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1.0 <= v <= 100.0:
                raise ConfigError(f"hardware {self.name!r}: field '{field}'={v!r} must be a number in "
                                  f"[1.0, 100.0] ({what})")

    @property
    def usable_hbm_bytes(self) -> float:
        """HBM the instance may fill with weights, staging and KV, summed over its GPUs."""
        return self.num_gpus * self.hbm_gib_per_gpu * GIB * self.memory_utilization

    @property
    def host_kv_bytes_budget(self) -> float:
        return (self.host_memory_gb - self.host_reserve_gb) * GB


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about one served model variant. Built from the variant's
    ``ModelConfig`` (configs/models/) by ``from_config``; ``talaria_jax.sim.toys`` builds hand-computable ones."""

    name: str
    weight_bytes: float      # all weights in the served precision(s)
    active_params_b: float   # parameters touched per token, billions (2 FLOPs each per token)
    layers: int
    full_attn_layers: int    # layers attending to the whole context (the rest hold a bounded window)
    kv_bytes_per_token: int  # physical over all TP ranks, full-attention layers only
    attn_dim: int            # query heads x head dim (attention FLOPs grow with this times context)
    hidden: int
    num_experts: int
    top_k: int
    expert_fraction: float   # share of weight bytes that are routed experts (decode reads only the touched ones)
    tp: int                  # tensor-parallel degree kv_bytes_per_token is physical at

    @property
    def weights_gb(self) -> float:
        return self.weight_bytes / GB

    @classmethod
    def from_config(cls, cfg: ModelConfig, weight_dtype: str, tp: int, *, quant: QuantConfig | None = None,
                    name: str | None = None) -> "ModelShape":
        """The shape of `cfg` served with weights in `weight_dtype`, its linear weights stored as `quant`
        says (default: the config's own `quant`, as the checkpoint ships), by one instance of
        tensor-parallel degree `tp`.

        Every figure is ModelConfig arithmetic: weight bytes = ``weight_bytes()`` (every parameter at
        the precision, quantized matrices at their values' and scales' bytes: what the loaded arrays
        hold, tests/weights/test_quant_checkpoints.py), active parameters = ``active_param_count()``,
        full-attention layers = layers with no sliding window, KV bytes = ``kv_bytes_per_token()`` with
        kv heads replicated up to `tp` when there are fewer kv heads than ranks (each rank holds at
        least one, docs/references.md: Qwen3-235B's 188 KiB is 376 KiB physical at TP=8). Raises
        ConfigError for an unknown precision."""
        if tp < 1:
            raise ConfigError(f"{cfg.name}: tp={tp} must be >= 1")
        try:
            bytes_per_weight(weight_dtype)
        except ConfigError as e:
            raise ConfigError(f"{cfg.name}: field 'weight_dtype'={weight_dtype!r}: {e}") from None
        cfg = cfg.replace(weight_dtype=weight_dtype, quant=quant or cfg.quant)
        weight_bytes = cfg.weight_bytes()
        kv_per_rank = math.ceil(cfg.num_kv_heads / tp)
        return cls(
            name=name or cfg.name, weight_bytes=float(weight_bytes), active_params_b=cfg.active_param_count() / 1e9,
            layers=cfg.num_layers, full_attn_layers=sum(1 for l in range(cfg.num_layers) if cfg.window(l) == 0),
            kv_bytes_per_token=cfg.kv_bytes_per_token() * tp * kv_per_rank // cfg.num_kv_heads,
            attn_dim=cfg.q_size, hidden=cfg.hidden_size, num_experts=cfg.moe.num_experts if cfg.moe else 0,
            top_k=cfg.moe.top_k if cfg.moe else 0,
            expert_fraction=cfg.routed_expert_bytes() / weight_bytes, tp=tp)


# (field, lower bound, upper bound); bounds are sanity limits, not physics.
_HW_LIMITS: dict[str, tuple[float, float]] = {
    "num_gpus": (1, 1024), "hbm_gib_per_gpu": (1, 4096), "memory_utilization": (0.05, 1.0),
    "hbm_bw_gbps": (1, 1e5), "hbm_bw_efficiency": (0.01, 1.0), "matmul_tflops": (0.001, 1e5),
    "prefill_efficiency": (0.01, 1.0), "nvlink_gbps": (0.1, 1e5), "allreduce_latency_us": (0, 1e5),
    "step_overhead_us": (0, 1e7),
    "pcie_h2d_gbps": (0.1, 1e4), "pcie_d2h_gbps": (0.1, 1e4), "weight_load_efficiency": (0.01, 1.0),
    "d2d_gbps": (1, 1e5), "host_memory_gb": (1, 1e6), "host_reserve_gb": (0, 1e6),
    "staging_step_slowdown": (1.0, 100.0), "colocated_step_slowdown": (1.0, 100.0),
    "kv_bw_efficiency": (0.01, 1.0), "attention_efficiency": (0.001, 1.0), "compute_memory_overlap": (0.0, 1.0),
    "verify_token_overhead_us": (0, 1e6), "tile_walk_efficiency": (0.01, 100.0),
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
        p = config_io.CONFIG_DIR / subdir / f"{p}.yaml"
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    return p


def load_hardware(path: str | pathlib.Path) -> HardwareConfig:
    """Loads a hardware YAML (a path, or a name under configs/hardware/)."""
    p = _resolve(path, "hardware")
    raw = yaml.safe_load(p.read_text())
    name = raw.get("name", p.stem) if isinstance(raw, dict) else p.stem
    return _checked("hardware", str(p), raw, HardwareConfig, _HW_LIMITS, {"name": str(name)})


DEFAULT_MODELS_TABLE = config_io.CONFIG_DIR / "hardware" / "models.yaml"
_VARIANT_FIELDS = {"config": True, "weight_dtype": True, "quant": False}  # field: required
# The precision of a model named in a trace by its config name (configs/models/<name>.yaml) when the
# table has no variant of that name: every weight in bf16, as the configs' checkpoints ship.
DEFAULT_WEIGHT_DTYPE = "bfloat16"


def load_models(path: str | pathlib.Path = DEFAULT_MODELS_TABLE, tp: int | None = None,
                extra: Iterable[str] = ()) -> dict[str, ModelShape]:
    """Loads the served-variant table (configs/hardware/models.yaml): each variant names a model config
    under configs/models/ and a weight precision; its ``ModelShape`` is derived from that config at
    tensor-parallel degree `tp` (default: the file's ``tensor_parallel``). Keys are the variant names
    used in traces. A bad entry raises ``ConfigError`` naming the file, the variant and the field.

    `extra` names models a trace uses: each one the table has no variant of but that is a config name
    under configs/models/ gets that config's shape at ``DEFAULT_WEIGHT_DTYPE`` (bf16); a name that is
    neither is left out, for the caller to report with its trace line."""
    p = _resolve(path, "hardware")
    raw = yaml.safe_load(p.read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("variants"), dict):
        raise ConfigError(f"{p}: top-level field 'variants' must be a mapping of variant name to "
                          f"{{config, weight_dtype}}")
    if tp is None:
        tp = raw.get("tensor_parallel")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"{p}: field 'tensor_parallel' must be an int >= 1, got {tp!r}")
    out = {}
    for name, entry in raw["variants"].items():
        where = f"{p}: variants.{name}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: must be a mapping with fields {sorted(_VARIANT_FIELDS)}, got {entry!r}")
        unknown = sorted(set(entry) - set(_VARIANT_FIELDS))
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; known: {sorted(_VARIANT_FIELDS)}")
        for field, required in _VARIANT_FIELDS.items():
            if required and field not in entry:
                raise ConfigError(f"{where}: missing field '{field}'")
            if field in entry and field != "quant" and not (isinstance(entry[field], str) and entry[field]):
                raise ConfigError(f"{where}: field '{field}' must be a non-empty string, got {entry[field]!r}")
        try:
            cfg = load_model_config(entry["config"])
        except ConfigError as e:
            raise ConfigError(f"{where}: field 'config'={entry['config']!r}: {e}") from None
        try:
            quant = config_io.from_dict(QuantConfig, entry["quant"], "quant") if "quant" in entry else None
            out[str(name)] = ModelShape.from_config(cfg, entry["weight_dtype"], tp, quant=quant, name=str(name))
        except ValueError as e:  # ConfigError and QuantError
            raise ConfigError(f"{where}: {e}") from None
    configs = set(available_models())
    for name in extra:
        if name not in out and name in configs:
            out[name] = ModelShape.from_config(load_model_config(name), DEFAULT_WEIGHT_DTYPE, tp, name=name)
    return out
