"""A decoder's parameters as sharded arrays on a mesh, and the full-sequence reference forward.

State lives outside jitted functions: `ShardedModel` holds the graph definition, the parameter
state (sharded by `talaria_jax.sharding.rules`) and the mesh; `forward` is pure.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from talaria_jax.models import layers
from talaria_jax.models.config import ModelConfig
from talaria_jax.models.decoder import Decoder, linear_axes
from talaria_jax.sharding import make_mesh, state_shardings


@dataclasses.dataclass
class ShardedModel:
    cfg: ModelConfig
    mesh: Mesh
    graphdef: Any
    state: Any
    # Identity of the weights (their source and a digest of it): KV or a prefix cache made by other
    # weights of the same shapes must not be reused. Loaders set it; see `weights_fingerprint`.
    fingerprint: str = ""

    def module(self) -> Decoder:
        return nnx.merge(self.graphdef, self.state)

    def param_arrays(self) -> dict[str, jax.Array]:
        """Flat {'blocks.0.attn.q_proj': array} view of the parameters."""
        return {".".join(map(str, k)): var.get_value() for k, var in nnx.to_flat_state(self.state)}


def abstract_model(cfg: ModelConfig, mesh: Mesh) -> tuple[Any, Any, Any]:
    """(graphdef, abstract state, shardings) without allocating any parameter."""
    abstract = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return graphdef, state, state_shardings(state, mesh)


def init_model(cfg: ModelConfig, mesh: Mesh | None = None, seed: int = 0) -> ShardedModel:
    """Random-initialised parameters created directly in their shards (no full replica per device)."""
    mesh = mesh or make_mesh(jax.devices()[:1])
    graphdef, _, shardings = abstract_model(cfg, mesh)

    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        return nnx.state(Decoder(cfg, nnx.Rngs(seed)))

    with jax.set_mesh(mesh):
        state = init()
    return ShardedModel(cfg, mesh, graphdef, state, weights_fingerprint("random", cfg.name, seed, repr(cfg)))


def param_name(path) -> str:
    """'blocks.0.attn.q_proj' for a pytree path into a model's state, its pure dict or a flat dict."""
    name = jax.tree_util.keystr(tuple(path), simple=True, separator=".")
    return name.removesuffix(".value")


def with_params(model: ShardedModel, params: Any, tag: str = "") -> ShardedModel:
    """`model` with new parameter values: `params` is an nnx.State of the same module, its
    `to_pure_dict()`, or a flat {'blocks.0.attn.q_proj': array} dict (`param_arrays()`), on any
    devices (a trainer's). Each array is cast to the model's dtype and placed with the model's
    sharding, so the result runs on the model's mesh and its compiled programs. A missing, unknown or
    misshapen parameter is a ValueError naming it. The fingerprint changes (KV and prefix caches of
    the old weights are then never reused): it digests the old one and `tag` (pass a unique one)."""
    given = {param_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = model.param_arrays()
    missing, unknown = sorted(want.keys() - given.keys()), sorted(given.keys() - want.keys())
    if missing or unknown:
        raise ValueError(f"params do not match {model.cfg.name}: missing {missing[:5]}, unknown {unknown[:5]}"
                         f" ({len(missing)} missing, {len(unknown)} unknown)")
    for name, old in want.items():
        if tuple(np.shape(given[name])) != old.shape:
            raise ValueError(f"params[{name!r}] has shape {tuple(np.shape(given[name]))}; {model.cfg.name} "
                             f"needs {old.shape}")

    def put(path, old):  # straight into the shards (no whole copy on a default device), cast there
        return jax.device_put(given[param_name(path)], old.sharding).astype(old.dtype)

    state = jax.tree_util.tree_map_with_path(put, model.state)
    return dataclasses.replace(model, state=state, fingerprint=weights_fingerprint(model.fingerprint, "update", tag))


def dequantized(model: ShardedModel) -> ShardedModel:
    """`model` with every quantized weight (values and scales, `cfg.quant`) turned into one array in the
    compute dtype, on the same mesh and shardings as an unquantized model of that config: the
    dequantize-then-compute reference a quantized model is checked against. Unquantized: `model`."""
    if model.cfg.quant is None:
        return model
    cfg = model.cfg.replace(quant=None)
    graphdef, abstract, shardings = abstract_model(cfg, model.mesh)
    have = model.param_arrays()
    flat_abs = dict(nnx.to_flat_state(abstract))
    flat_sh = dict(nnx.to_flat_state(shardings))
    arrays = {}
    for key in flat_abs:
        name = ".".join(map(str, key))
        if f"{name}_scale" not in have:
            arrays[key] = have[name]
            continue
        fn = functools.partial(layers.dequantize, q=model.cfg.quant, axes=linear_axes(cfg, name),
                               dtype=jnp.dtype(cfg.dtype))
        arrays[key] = jax.jit(fn, out_shardings=flat_sh[key].get_value())(have[name], have[f"{name}_scale"])
    state = nnx.from_flat_state([(k, flat_abs[k].replace(arrays[k])) for k in flat_abs])
    return ShardedModel(cfg, model.mesh, graphdef, state, weights_fingerprint(model.fingerprint, "dequantized"))


def weights_fingerprint(*parts: Any) -> str:
    """A short stable digest of what identifies a set of weights (source, config, content digests)."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=12).hexdigest()


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, positions):
    return nnx.merge(graphdef, state)(tokens, positions)


def forward(model: ShardedModel, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """fp32 logits [B, T, V] for a right-padded batch; positions -1 mark padding."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
    with jax.set_mesh(model.mesh):
        return _forward(model.graphdef, model.state, tokens, jnp.asarray(positions, jnp.int32))


def pad_batch(prompts: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists to `length`: (tokens [B, length], positions with -1 at padding)."""
    b = len(prompts)
    tokens = np.full((b, length), pad_id, np.int32)
    positions = np.full((b, length), -1, np.int32)
    for i, p in enumerate(prompts):
        if len(p) > length:
            raise ValueError(f"prompt {i} has {len(p)} tokens; the limit is {length}")
        tokens[i, : len(p)] = p
        positions[i, : len(p)] = np.arange(len(p))
    return tokens, positions


def greedy_generate(model: ShardedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation by full-sequence recompute (no KV cache): the reference the paged engine
    is tested against. One compiled shape per (batch, prompt+new) length."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    length = max(len(p) for p in prompts) + max_new_tokens
    seqs = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        tokens, positions = pad_batch(seqs, length)
        logits = np.asarray(forward(model, tokens, positions))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompts)]
