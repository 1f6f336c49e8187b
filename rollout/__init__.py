"""WAR: workload-aware rollouts. Suffix-tree speculative decoding (suffix.py drafts, verify.py verifies
inside the engine's jitted step, policy.py decides how many drafts a step verifies), cache-aware
placement of rollout requests on replicas (placement.py), and the rollout service for RL loops
(service.py in process, server.py over HTTP, ray_replicas.py for replicas as Ray actors)."""
from talaria_jax.rollout.placement import CacheAware, LeastLoaded, Placement, PrefixIndex, RoundRobin, make_placement
from talaria_jax.rollout.policy import SpecPolicy
from talaria_jax.rollout.suffix import Draft, SpecConfig, SuffixDrafter, SuffixTree, TokenScan

# The service and replicas import the engine, which imports this package (drafts, verifier): load on use.
_LAZY = {"Completion": "replica", "Replica": "replica", "ReplicaSpec": "replica", "RolloutService": "service",
         "Trajectory": "service"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"talaria_jax.rollout.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'talaria_jax.rollout' has no attribute {name!r}")


__all__ = ["CacheAware", "Completion", "Draft", "LeastLoaded", "Placement", "PrefixIndex", "Replica", "ReplicaSpec",
           "RolloutService", "RoundRobin", "SpecConfig", "SpecPolicy", "SuffixDrafter", "SuffixTree", "TokenScan",
           "Trajectory", "make_placement"]
