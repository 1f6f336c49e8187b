"""WAR: workload-aware rollouts over the engine. Cache-aware placement of rollout requests on
replicas (placement.py), replicas (replica.py, an engine each), the rollout service for RL
loops (service.py in process, server.py over HTTP, ray_replicas.py for replicas as Ray actors), and
a Tunix rollout engine over the service (tunix_rollout.py: import it from there; it needs the
`[tunix]` extra).
Speculative decoding is the engine's (talaria_jax.engine.spec); `SpecConfig` is re-exported here
because `ReplicaSpec` takes one."""
from talaria_jax.engine.spec import SpecConfig
from talaria_jax.rollout.placement import CacheAware, LeastLoaded, Placement, PrefixIndex, RoundRobin, make_placement
from talaria_jax.rollout.replica import Completion, Partial, Replica, ReplicaSpec
from talaria_jax.rollout.service import RolloutService, Trajectory

__all__ = ["CacheAware", "Completion", "LeastLoaded", "Partial", "Placement", "PrefixIndex", "Replica", "ReplicaSpec",
           "RolloutService", "RoundRobin", "SpecConfig", "Trajectory", "make_placement"]
