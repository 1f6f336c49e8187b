"""WAR: workload-aware rollouts. Suffix-tree speculative decoding (suffix.py drafts, verify.py verifies
inside the engine's jitted step, policy.py decides how many drafts a step verifies)."""
from talaria_jax.rollout.policy import SpecPolicy
from talaria_jax.rollout.suffix import Draft, SpecConfig, SuffixDrafter, SuffixTree, TokenScan

__all__ = ["Draft", "SpecConfig", "SpecPolicy", "SuffixDrafter", "SuffixTree", "TokenScan"]
