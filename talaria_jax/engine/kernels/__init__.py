"""Fused kernels behind the engine's plain-jnp references (which stay the spec they are tested against)."""
from talaria_jax.engine.kernels.ragged_paged_attention import check_shapes, on_gpu, ragged_paged_attention

__all__ = ["check_shapes", "on_gpu", "ragged_paged_attention"]
