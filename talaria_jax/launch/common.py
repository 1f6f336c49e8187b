"""What the launchers share: the model on the first `tp` devices, with the persistent compilation cache."""
from __future__ import annotations

from absl import app


def load_on_devices(model: str, tp: int, *, dtype: str | None, compilation_cache: str | None, **load_kw):
    """`load_model(model)` on a mesh of the first `tp` devices, after turning on the compilation cache
    (`compilation_cache`: a folder, None for the default, 'off'); a bad --tp or checkpoint is a usage
    error naming it."""
    import jax

    from talaria_jax.engine import enable_compilation_cache
    from talaria_jax.sharding import make_mesh
    from talaria_jax.weights import CheckpointError, load_model

    if compilation_cache != "off":
        enable_compilation_cache(compilation_cache)
    if tp > jax.device_count():
        raise app.UsageError(f"--tp={tp} exceeds the {jax.device_count()} available devices")
    mesh = make_mesh(jax.devices()[:tp])
    try:
        return load_model(model, mesh, dtype=dtype, **load_kw)
    except CheckpointError as e:
        raise app.UsageError(str(e)) from None


def spec_config(max_spec_tokens: int):
    """The engines' speculation for a launcher's --speculate (0: none)."""
    from talaria_jax.rollout.suffix import SpecConfig

    return SpecConfig(max_spec_tokens=max_spec_tokens) if max_spec_tokens else None


def instance_apps(models: dict[str, str], *, instances: int, tp: int, policy: str, dtype: str | None, engine_config,
                  kv_bytes_per_device: int | None, hardware: str | None, api_keys: list[str], limits,
                  tenant_secret: bytes | None, compilation_cache: str | None) -> list:
    """`serve.local_cluster.instance_apps` for a launcher: the compilation cache on, names resolved
    (`hardware` None: cpu on the CPU backend, h200x8 elsewhere), and a bad model, policy, profile or
    device count a usage error naming it."""
    import jax

    from talaria_jax.engine import enable_compilation_cache
    from talaria_jax.scheduler.policies import get_policy
    from talaria_jax.serve import local_cluster
    from talaria_jax.sim.hardware import ConfigError, load_hardware
    from talaria_jax.weights import CheckpointError

    if compilation_cache != "off":
        enable_compilation_cache(compilation_cache)
    if not models:
        raise app.UsageError("--model: give at least one model")
    try:
        return local_cluster.instance_apps(models, load_hardware(hardware or ("cpu" if jax.default_backend() == "cpu"
                                                                              else "h200x8")),
                                           get_policy(policy), instances=instances, devices_per_instance=tp,
                                           engine_config=engine_config, kv_bytes_per_device=kv_bytes_per_device,
                                           api_keys=api_keys, limits=limits, dtype=dtype, tenant_secret=tenant_secret)
    except (CheckpointError, ConfigError, ValueError) as e:
        raise app.UsageError(str(e)) from None
