"""One typed configuration of a served instance (as vLLM's `VllmConfig` of typed parts): what it hosts
(`models`, `dtype`, `devices`), how its engines run (`engine`), its KV and host budgets, the policy
its scheduler runs and the profile its estimates read, and its HTTP server (`ServerConfig`). Built
once, from `talaria-serve`'s flags or a YAML file (`InstanceConfig.from_file`, fields as named here),
or in code, and handed down whole: `local_cluster.instance_apps(config)` builds the instances, their
schedulers and their servers from it.

    # instance.yaml (talaria-serve --config=instance.yaml)
    models: {smol: smollm2-135m-instruct, tiny: tiny-dense}
    policy: talaria
    engine: {max_seqs: 8, max_model_len: 2048, prefix_cache: true}
    kv_bytes_per_device: 268435456
    host_kv_bytes: 1073741824
    server: {api_keys: [sk-local], limits: {max_tokens: 1024}}
"""
from __future__ import annotations

import dataclasses
import pathlib

import yaml

from talaria_jax import config_io
from talaria_jax.engine.engine import EngineConfig
from talaria_jax.instance import check_weight_budget
from talaria_jax.scheduler.policies import PolicyConfig, get_policy
from talaria_jax.serve.protocol import Limits
from talaria_jax.serve.tools import PARSERS
from talaria_jax.sim.hardware import HardwareConfig, load_hardware

__all__ = ["InstanceConfig", "ServerConfig"]


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """An instance's HTTP server: API keys (each a tenant), request limits, the key of the tenant salts
    (None: random per process), sessions kept (`max_sessions`, each until idle for `session_ttl_s`),
    how tool calls are read (`tool_call_parser`; auto: from the chat template) and a chat template
    to use instead of the model's (Jinja text), calls kept to infer the sessions of calls that name
    none (`inferred_calls`, 0: none), and the Responses API's stored responses."""
    api_keys: tuple[str, ...]
    limits: Limits = Limits()
    tenant_secret: str | None = None
    max_sessions: int = 10_000
    session_ttl_s: float = 3600.0
    tool_call_parser: str = "auto"
    chat_template: str | None = None
    inferred_calls: int = 65_536
    responses_stored: int = 10_000
    responses_ttl_s: float = 3600.0

    def __post_init__(self):
        if isinstance(self.api_keys, str) or not self.api_keys or not all(
                isinstance(k, str) and k for k in self.api_keys):
            raise config_io.ConfigError(f"ServerConfig.api_keys: give at least one non-empty key, got "
                                        f"{self.api_keys!r}")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        for f in ("max_sessions", "responses_stored"):
            if getattr(self, f) < 1:
                raise config_io.ConfigError(f"ServerConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.inferred_calls < 0:
            raise config_io.ConfigError(f"ServerConfig.inferred_calls must be >= 0, got {self.inferred_calls}")
        for f in ("session_ttl_s", "responses_ttl_s"):
            if not getattr(self, f) > 0:
                raise config_io.ConfigError(f"ServerConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.tool_call_parser not in PARSERS:
            raise config_io.ConfigError(f"ServerConfig.tool_call_parser must be one of {list(PARSERS)}, got "
                                        f"{self.tool_call_parser!r}")


@dataclasses.dataclass(frozen=True)
class InstanceConfig:
    """A served instance; see the module docstring. `models`: served name -> what
    ``weights.load_model`` loads (a named model, a checkpoint folder or file, a configs/models/ config
    with random weights). `policy`: a policy name (``scheduler.policies``); `hardware`: the profile of
    the scheduler's estimates (configs/hardware/; None: cpu on the CPU backend, h200x8 elsewhere).
    `devices`: the instance's devices (its TP degree). `kv_bytes_per_device`: the KV arena of all its
    models, per device (None: as `engine` says); `host_kv_bytes`: host memory for session KV copies
    (None: unbounded). `resident`: every model keeps its own device arrays (no weight slot; for a CPU).
    `weight_budget`: models in arrays of their own taking turns on the devices under a budget, "largest"
    (the largest model's bytes; talaria-serve's default too), a number of bytes over the instance's
    devices, or "all" (every model stays) (``instance.resolve_weight_budget``); "slot": one weight slot
    the models share; None: as `resident` says (the slot where it is False)."""
    models: dict[str, str]
    server: ServerConfig
    engine: EngineConfig = EngineConfig(prefix_cache=True)
    policy: str = "talaria"
    hardware: str | None = None
    devices: int = 1
    dtype: str | None = None
    kv_bytes_per_device: int | None = None
    host_kv_bytes: int | None = None
    resident: bool = False
    weight_budget: str | int | None = "largest"

    def __post_init__(self):
        if not isinstance(self.models, dict) or not self.models or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.models.items()):
            raise config_io.ConfigError(f"InstanceConfig.models: give served name -> model (both non-empty "
                                        f"strings), got {self.models!r}")
        if self.devices < 1:
            raise config_io.ConfigError(f"InstanceConfig.devices must be >= 1, got {self.devices}")
        for f in ("kv_bytes_per_device", "host_kv_bytes"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise config_io.ConfigError(f"InstanceConfig.{f} must be a non-negative int or None, got {v!r}")
        try:
            if self.weight_budget != "slot":
                check_weight_budget(self.weight_budget)
        except ValueError as e:
            raise config_io.ConfigError(f"InstanceConfig.weight_budget: {e}, or 'slot'") from None
        if self.dtype not in (None, "float32", "bfloat16"):
            raise config_io.ConfigError(f"InstanceConfig.dtype must be float32, bfloat16 or None, got {self.dtype!r}")
        try:
            get_policy(self.policy)
            self.engine.validate()
        except ValueError as e:
            raise config_io.ConfigError(f"InstanceConfig: {e}") from None

    @classmethod
    def from_file(cls, path: str | pathlib.Path, api_keys: tuple[str, ...] = (), tenant_secret: str | None = None,
                  host_kv_bytes: int | None = None) -> "InstanceConfig":
        """The configuration in a YAML file, its server's API keys `api_keys` and tenant secret
        `tenant_secret` where it names none, and `host_kv_bytes` where it has no such field (`null`
        there: unbounded); ConfigError naming the file and the field."""
        name = pathlib.Path(path).name
        try:
            data = yaml.safe_load(pathlib.Path(path).read_text())
        except OSError as e:
            raise config_io.ConfigError(f"{path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise config_io.ConfigError(f"{name}: not YAML: {str(e)[:200]}") from None
        if not isinstance(data, dict):
            raise config_io.ConfigError(f"{name}: expected a mapping at the top level")
        data.setdefault("host_kv_bytes", host_kv_bytes)
        server = data.setdefault("server", {})
        if isinstance(server, dict):
            server["api_keys"] = server.get("api_keys") or list(api_keys)
            server["tenant_secret"] = server.get("tenant_secret") or tenant_secret
        try:
            return config_io.from_dict(cls, data, where=name)
        except (TypeError, ValueError) as e:  # a field's own check names the field, not yet the file
            message = str(e)
            raise config_io.ConfigError(message if message.startswith(name) else f"{name}: {message}") from None

    def policy_config(self) -> PolicyConfig:
        return get_policy(self.policy)

    def hardware_config(self, backend: str) -> HardwareConfig:
        """The profile of the scheduler's estimates, on a `backend` (jax.default_backend()) machine."""
        return load_hardware(self.hardware or ("cpu" if backend == "cpu" else "h200x8"))
