"""Speculative decoding, an engine feature: suffix-tree drafts with no draft model (suffix.py), a
lossless verifier inside the jitted step (verify.py), and the policy that decides how many draft
tokens a step verifies from the measured step-cost curve (policy.py)."""
from talaria_jax.engine.spec.policy import SpecPolicy
from talaria_jax.engine.spec.suffix import Draft, SpecConfig, SuffixDrafter, SuffixTree, TokenScan

__all__ = ["Draft", "SpecConfig", "SpecPolicy", "SuffixDrafter", "SuffixTree", "TokenScan"]
