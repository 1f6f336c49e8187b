"""Model configs and the Flax NNX decoder family.

Configs are pure Python; the decoder and the sharded-model helpers import JAX, so they load on
first use: `from talaria_jax.models.config import ...` (the simulator does) never imports JAX.
"""
from talaria_jax.models.config import (ModelConfig, MoEConfig, RopeScaling, available_models, bytes_per_weight,
                                       load_model_config)

_LAZY = {"Decoder": "talaria_jax.models.decoder", "ShardedModel": "talaria_jax.models.model",
         "forward": "talaria_jax.models.model", "greedy_generate": "talaria_jax.models.model",
         "init_model": "talaria_jax.models.model", "with_params": "talaria_jax.models.model"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'talaria_jax.models' has no attribute {name!r}")


__all__ = ["Decoder", "ModelConfig", "MoEConfig", "RopeScaling", "ShardedModel", "available_models",
           "bytes_per_weight", "forward", "greedy_generate", "init_model", "load_model_config",
           "with_params"]
