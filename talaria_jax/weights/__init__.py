"""Checkpoints: models by name (`load_model`), HF safetensors and GGUF import, Orbax save/restore."""
from talaria_jax.weights.checkpoint import restore, save
from talaria_jax.weights.gguf import config_from_gguf, load_gguf
from talaria_jax.weights.hf import CheckpointError, config_from_hf, load_hf_checkpoint
from talaria_jax.weights.named import NAMED_MODELS, LoadedModel, load_model

__all__ = ["NAMED_MODELS", "CheckpointError", "LoadedModel", "config_from_gguf", "config_from_hf", "load_gguf",
           "load_hf_checkpoint", "load_model", "restore", "save"]
