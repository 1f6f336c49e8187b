"""talaria-rollout: the rollout service for RL loops over HTTP, over several replicas of one model.

Defaults run on one CPU with no downloads: two replicas of the embedded SmolLM2-135M-Instruct, one
device each, WAR's cache-aware placement and suffix-tree speculation, on 127.0.0.1:8100.

  talaria-rollout --replicas=2 --devices_per_replica=4      # two TP=4 replicas on 8 devices
  talaria-rollout --ray --replicas=4 --devices_per_replica=8  # replicas as Ray actors (ray.init(address="auto"))
  curl -s 127.0.0.1:8100/v1/generate -H "Content-Type: application/json" \\
      -d '{"prompts": [[1, 2, 3]], "n": 2, "sampling": {"max_tokens": 8}}'

The API is in talaria_jax/rollout/server.py (`RolloutClient` is its Python client); the same service
in process is `talaria_jax.rollout.RolloutService`.
"""
from __future__ import annotations

import os
import sys

import uvicorn
from absl import app, flags, logging

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "The policy: a named model, .gguf file, HF or Orbax "
                             "checkpoint folder, or config name (random weights).")
_REPLICAS = flags.DEFINE_integer("replicas", 2, "Rollout replicas.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_replica", 1, "Devices of each replica's mesh (its TP degree).",
                                lower_bound=1)
_PLACEMENT = flags.DEFINE_enum("placement", "cache_aware", ["cache_aware", "round_robin", "least_loaded",
                                                              "sticky_least_loaded"],
                               "How requests are placed on replicas.")
_SPECULATE = flags.DEFINE_integer("speculate", 8, "Suffix-tree speculative decoding: draft tokens per request and "
                                  "step at most (0: off); used at a step only where the measured step cost says it "
                                  "pays.", lower_bound=0, upper_bound=31)
_MAX_SEQS = flags.DEFINE_integer("max_seqs", 16, "Sequences each replica runs at once.", lower_bound=1)
_MAX_LEN = flags.DEFINE_integer("max_model_len", 2048, "Context limit (tokens).", lower_bound=16)
_KV_MB = flags.DEFINE_integer("kv_mib_per_device", None, "KV pool per device in MiB (default: room for max_seqs "
                              "sequences of max_model_len).", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype (default: the checkpoint's).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of requests that carry none.", lower_bound=0)
_RAY = flags.DEFINE_bool("ray", False, "Replicas as Ray actors on the cluster of --ray_address.")
_RAY_ADDRESS = flags.DEFINE_string("ray_address", None, "Ray cluster to join (default: start a local one).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind (127.0.0.1: this machine only).")
_PORT = flags.DEFINE_integer("port", 8100, "Port to listen on.", lower_bound=0, upper_bound=65535)
_KEY = flags.DEFINE_string("api_key", None, "Comma-separated API keys (default $TALARIA_API_KEY; none: no auth).")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile every step shape before serving.")
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", 256 << 20, "Largest request body (bytes; larger: 413): a batch "
                                 "of long prompts, or generate_until's partials, is large.", lower_bound=1)
_XLA_CACHE = flags.DEFINE_string("compilation_cache", None, "Persistent compilation cache folder (default "
                                 "$TALARIA_COMPILATION_CACHE or ~/.cache/talaria_jax/xla); 'off' disables it.")


def build_replicas(spec_kw: dict, replicas: int, devices: int, use_ray: bool, ray_address: str | None) -> list:
    """The replicas of the flags: in process on consecutive device groups, or as Ray actors."""
    from talaria_jax.rollout.replica import ReplicaSpec

    if use_ray:
        from talaria_jax.rollout.ray_replicas import ray_replicas

        try:
            import ray
        except ImportError:
            raise app.UsageError("--ray needs ray: pip install 'talaria_jax[ray]'") from None
        ray.init(address=ray_address, ignore_reinit_error=True)
        gpus = devices if ray.cluster_resources().get("GPU", 0) else 0  # JAX stays off the driver's GPUs
        env = {} if gpus else {"JAX_PLATFORMS": "cpu",
                               "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        return ray_replicas(ReplicaSpec(**spec_kw), replicas, num_gpus=gpus, env_vars=env)
    import jax

    if replicas * devices > jax.device_count():
        raise app.UsageError(f"--replicas={replicas} x --devices_per_replica={devices} exceeds the "
                             f"{jax.device_count()} devices of this process")
    return [ReplicaSpec(devices=tuple(range(i * devices, (i + 1) * devices)), **spec_kw).build()
            for i in range(replicas)]


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from talaria_jax.engine import EngineConfig
    from talaria_jax.launch.common import spec_config
    from talaria_jax.rollout.server import make_app
    from talaria_jax.rollout.service import RolloutService

    cfg = EngineConfig(max_seqs=_MAX_SEQS.value, max_tokens_per_step=max(256, _MAX_SEQS.value),
                       max_model_len=_MAX_LEN.value, prefix_cache=True, warmup=_WARMUP.value,
                       kv_memory_bytes_per_device=_KV_MB.value * 2**20 if _KV_MB.value else None,
                       speculation=spec_config(_SPECULATE.value))
    spec_kw = dict(model=_MODEL.value, dtype=_DTYPE.value, engine=cfg,
                   compilation_cache=_XLA_CACHE.value or os.environ.get("TALARIA_COMPILATION_CACHE"))
    replicas = build_replicas(spec_kw, _REPLICAS.value, _DEVICES.value, _RAY.value, _RAY_ADDRESS.value)
    keys = [k.strip() for k in (_KEY.value or os.environ.get("TALARIA_API_KEY", "")).split(",") if k.strip()]
    with RolloutService(replicas, _PLACEMENT.value, seed=_SEED.value) as service:
        print(f"rollout service: {_MODEL.value} x {_REPLICAS.value} replicas ({_DEVICES.value} devices each"
              f"{', Ray actors' if _RAY.value else ''}), {_PLACEMENT.value} placement, on "
              f"http://{_HOST.value}:{_PORT.value}/v1", file=sys.stderr)
        uvicorn.run(make_app(service, keys, max_body_bytes=_MAX_BODY.value), host=_HOST.value, port=_PORT.value, log_level="warning")


def run():
    app.run(main)


if __name__ == "__main__":
    run()
