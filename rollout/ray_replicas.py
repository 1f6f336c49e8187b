"""Rollout replicas as Ray actors: the same `Replica` interface, each replica in its own worker
process (on its own GPUs on a cluster), so `RolloutService` scales over a Ray cluster the way verl
and SkyRL rollouts do. Ray is an optional extra: `pip install 'talaria_jax[ray]'`.

    ray.init()                                    # or ray.init(address="auto") on a cluster's node
    replicas = ray_replicas(ReplicaSpec("smollm2-135m-instruct"), count=2, num_gpus=8)
    service = RolloutService(replicas)

Each actor builds its replica from the spec in its own process (nothing but the spec is sent), and
`update_weights` ships the parameters once through Ray's object store as host numpy arrays, which
each actor places on its own mesh.
"""
from __future__ import annotations

from collections.abc import Sequence

from talaria_jax.rollout.replica import Completion, Replica, ReplicaInfo, ReplicaSpec

__all__ = ["RayReplica", "ray_replicas"]


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("Ray replicas need ray: pip install 'talaria_jax[ray]'") from None
    return ray


class _Actor:
    """Holds one Replica in a Ray worker process."""

    def __init__(self, spec: ReplicaSpec):
        self.replica: Replica = spec.build()

    def call(self, method: str, *args):
        return getattr(self.replica, method)(*args)


def host_params(params) -> dict:
    """A flat {name: numpy array} copy of a parameter pytree (what `models.with_params` takes)."""
    import jax
    import numpy as np

    from talaria_jax.models.model import param_name

    return {param_name(p): np.asarray(jax.device_get(v)) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


class RayReplica:
    """A Ray actor behind the `Replica` interface: each call waits for the actor's answer."""

    def __init__(self, actor):
        self.actor = actor
        self._ray = _ray()

    def _call(self, method: str, *args):
        return self._ray.get(self.actor.call.remote(method, *args))

    def info(self) -> ReplicaInfo:
        return self._call("info")

    def add(self, requests) -> list[Completion]:
        return self._call("add", requests)

    def step(self, max_steps: int = 1, speculate: bool = True) -> list[Completion]:
        return self._call("step", max_steps, speculate)

    def abort(self, request_ids: Sequence[str]) -> list[Completion]:
        return self._call("abort", list(request_ids))

    def update_weights(self, params) -> None:
        """params: a pytree, or `share_weights(params)` (what the service passes: one copy for all)."""
        self._call("update_weights", params if isinstance(params, self._ray.ObjectRef) else self.share_weights(params))

    @staticmethod
    def share_weights(params):
        """The parameters in Ray's object store, once, as host arrays: an ObjectRef every actor reads."""
        return _ray().put(host_params(params))

    def stats(self) -> dict:
        return self._call("stats")

    def close(self) -> None:
        self._ray.kill(self.actor)


def ray_replicas(spec: ReplicaSpec | Sequence[ReplicaSpec], count: int | None = None, *, num_gpus: float = 0,
                 num_cpus: float = 1, env_vars: dict[str, str] | None = None) -> list[RayReplica]:
    """Starts one actor per spec (or `count` of one spec) on the connected Ray cluster and waits
    until each has built its replica. `num_gpus` per actor (a replica's mesh: 8 for a TP=8 server);
    `env_vars` for the actors' processes (e.g. XLA_FLAGS for simulated CPU devices)."""
    ray = _ray()
    specs = [spec] * (count or 1) if isinstance(spec, ReplicaSpec) else list(spec)
    if not ray.is_initialized():
        raise RuntimeError("ray is not initialized: call ray.init() (or ray.init(address=...)) first")
    options = dict(num_gpus=num_gpus, num_cpus=num_cpus)
    if env_vars:
        options["runtime_env"] = {"env_vars": dict(env_vars)}
    cls = ray.remote(_Actor).options(**options)
    replicas = [RayReplica(cls.remote(s)) for s in specs]
    try:
        for r in replicas:
            r.info()  # raises the actor's construction error here, not at the first request
    except Exception:
        for r in replicas:
            r.close()
        raise
    return replicas
