"""Model configs and the Flax NNX decoder family."""
from talaria_jax.models.config import ModelConfig, MoEConfig, RopeScaling, available_models, load_model_config
from talaria_jax.models.decoder import Decoder
from talaria_jax.models.model import ShardedModel, forward, greedy_generate, init_model

__all__ = ["Decoder", "ModelConfig", "MoEConfig", "RopeScaling", "ShardedModel", "available_models", "forward",
           "greedy_generate", "init_model", "load_model_config"]
