"""Checkpoints: HF safetensors import and Orbax save/restore."""
from talaria_jax.weights.checkpoint import restore, save
from talaria_jax.weights.hf import CheckpointError, config_from_hf, load_hf_checkpoint

__all__ = ["CheckpointError", "config_from_hf", "load_hf_checkpoint", "restore", "save"]
