"""One preallocated device buffer that holds the active model's weights, whichever model that is.

An instance serving several models keeps one model's weights on its devices at a time. They live in
a `WeightSlot`: a flat buffer of unsigned words per device ([devices, words], one row per device,
sharded over every mesh axis) allocated once, so the memory it takes is reserved up front and its
per-shard addresses never change. A model's parameters are carved out of that buffer inside the
jitted step (`carve`: slice, bitcast, reshape per leaf in a shard_map), so models of different
shapes share the slot: `SlotLayout` says where each parameter's shard sits in a device's row.

What carving costs: XLA has no views into a buffer, so each slice the step reads is materialized
(a copy of that parameter per step, fused with the bitcast) unless the backend reads it in place
(XLA:GPU's dynamic-slice fusion is meant to, for GEMM operands; not yet checked on a GPU). On XLA:CPU
every parameter is copied each step: decode of a 125M-parameter model ran ~4x slower than over the
model's own arrays (benchmarks/model_switch.py). Rows are words as wide as most parameters'
elements (`word_for`): then each bitcast is free, where a width-changing one would be expanded into
shifts and ors.

Switching models:
- `HostWeights.of(model)`: the model's rows in (pinned) host memory, built from each parameter's own
  shards (no full replica is gathered anywhere);
- `WeightSlot.stage(host)`: an asynchronous host-to-device copy into a staging buffer, issued while
  the current model keeps serving;
- `WeightSlot.activate_staged()`: a device-to-device copy from staging into the slot, in place (the
  slot is donated into a jitted dynamic_update_slice, so it keeps its buffers);
- `WeightSlot.load(host)`: host-to-device straight into the slot (no staging, the slow path).

A `Runner` reads the slot instead of its model's state after `runner.use_slot(slot, layout)`; it
refuses to step while the slot holds another model's weights (`WeightSlot.require_active`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from talaria_jax.kvcache.host_tier import host_memory_kind
from talaria_jax.models.model import ShardedModel

ALIGN = 64  # bytes; each parameter's shard starts at a multiple of this in a device's row


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def row_spec(mesh: Mesh) -> P:
    """The slot's PartitionSpec: dim 0 (one row per device) over every mesh axis, in mesh order, so
    row i lives on mesh.devices.flat[i]."""
    return P(tuple(mesh.axis_names), None)


@dataclasses.dataclass(frozen=True)
class LeafSlot:
    """Where one parameter's per-device shard sits in a device's row, and what it is."""
    shape: tuple[int, ...]  # per-device shard shape
    dtype: np.dtype
    spec: P  # the parameter's PartitionSpec on the mesh
    offset: int  # bytes from the start of the row (a multiple of ALIGN)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """How one model's parameters are laid out in a slot's per-device rows of `word`s. Frozen and
    hashable, so the runner passes it to jit as a static argument (one compiled step per layout)."""
    name: str  # the model's config name, for error messages
    mesh: Mesh
    leaves: tuple[LeafSlot, ...]  # in jax.tree.flatten order of the model's nnx State
    treedef: Any  # rebuilds the nnx State from the carved leaves
    bytes_per_device: int  # a multiple of ALIGN
    word: np.dtype  # the rows' element type: an unsigned int as wide as most of the parameters' bytes

    @classmethod
    def of(cls, model: ShardedModel, word: Any = None) -> "SlotLayout":
        """The layout of `model`'s parameters (concrete arrays, or ShapeDtypeStructs with shardings).
        word: the rows' element type (default: `word_for` the parameters), to match a slot's."""
        values, treedef = jax.tree.flatten(model.state)
        leaves, offset = [], 0
        for path, v in zip(_paths(model.state), values):
            s = v.sharding
            if not isinstance(s, NamedSharding) or s.mesh != model.mesh:
                raise ValueError(f"{model.cfg.name}: parameter {path} is not sharded on the model's mesh "
                                 f"(sharding {s}); a slot carves NamedSharding parameters of one mesh")
            leaf = LeafSlot(tuple(s.shard_shape(v.shape)), np.dtype(v.dtype), s.spec, offset)
            leaves.append(leaf)
            offset = _aligned(offset + leaf.nbytes)
        word = word_for(leaves) if word is None else np.dtype(word)
        return cls(model.cfg.name, model.mesh, tuple(leaves), treedef, offset, word)

    @property
    def words_per_device(self) -> int:
        return self.bytes_per_device // self.word.itemsize

    def __hash__(self) -> int:  # jit hashes static args on every call: compute it once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.name, self.mesh, self.leaves, self.treedef, self.bytes_per_device, self.word))
            object.__setattr__(self, "_hash", h)
        return h


def word_for(leaves) -> np.dtype:
    """The unsigned int as wide as the parameters holding the most bytes. A parameter of that width is
    a plain bitcast of its slice of the row; one of another width needs a conversion each step
    (XLA expands a width-changing bitcast into shifts), so the slot's word follows the bulk."""
    by_size: dict[int, int] = {}
    for leaf in leaves:
        by_size[leaf.dtype.itemsize] = by_size.get(leaf.dtype.itemsize, 0) + leaf.nbytes
    return np.dtype(f"uint{8 * max(by_size, key=by_size.get, default=4)}")


def _paths(state) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def carve(flat: jax.Array, layout: SlotLayout) -> Any:
    """The nnx State of `layout`'s model read from `flat` (a slot's [devices, words] array, or a
    HostWeights' data on device), for use inside jit: on each device, each parameter's shard is
    sliced out of the device's row, bitcast to its dtype and reshaped; shard_map reassembles the
    global arrays with the parameters' own PartitionSpecs. check_vma is off because replicated
    parameters are replicated by construction (every device's row holds the same copy)."""

    def local(row):  # [1, words] on one device
        return tuple(_view(row[0], leaf) for leaf in layout.leaves)

    values = jax.shard_map(local, mesh=layout.mesh, in_specs=row_spec(layout.mesh),
                           out_specs=tuple(leaf.spec for leaf in layout.leaves), check_vma=False)(flat)
    return jax.tree.unflatten(layout.treedef, values)


def _view(row: jax.Array, leaf: LeafSlot) -> jax.Array:
    """`leaf`'s shard from a device's row of words (offsets are multiples of ALIGN, so of any word)."""
    w, size = row.dtype.itemsize, leaf.dtype.itemsize
    x = row[leaf.offset // w:(leaf.offset + leaf.nbytes + w - 1) // w]
    if size > w:  # several words per element: bitcast_convert_type folds a trailing dim of them
        x = jax.lax.bitcast_convert_type(x.reshape(-1, size // w), leaf.dtype)
    else:  # one word per element (a plain bitcast), or several elements per word (a trailing dim)
        x = jax.lax.bitcast_convert_type(x, leaf.dtype).reshape(-1)[:math.prod(leaf.shape)]
    return x.reshape(leaf.shape)


@dataclasses.dataclass(frozen=True)
class HostWeights:
    """A model's per-device rows [devices, layout.words_per_device] of layout.word in host memory of
    the mesh's devices (pinned where the backend has it; a numpy array where it has no host memory
    kind)."""
    data: jax.Array | np.ndarray
    layout: SlotLayout
    fingerprint: str  # ShardedModel.fingerprint: which weights these are

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def nbytes(self) -> int:
        """Bytes over all devices' rows: what a load or staging copies."""
        return self.layout.bytes_per_device * self.layout.mesh.devices.size

    @classmethod
    def of(cls, model: ShardedModel, layout: SlotLayout | None = None) -> "HostWeights":
        """Copies `model`'s parameters to host memory, one row per device built from the shards that
        device holds (so nothing is gathered whole; on several hosts each fills its own rows).
        layout: SlotLayout.of(model) unless given (e.g. with another word, to match a slot)."""
        layout = layout or SlotLayout.of(model)
        values = jax.tree.leaves(model.state)
        devices = list(model.mesh.devices.flat)

        def row(i: int) -> np.ndarray:
            out = np.zeros((1, layout.bytes_per_device), np.uint8)
            for v, leaf in zip(values, layout.leaves):
                shard = next(s for s in v.addressable_shards if s.device == devices[i])
                out[0, leaf.offset:leaf.offset + leaf.nbytes] = np.asarray(shard.data).reshape(-1).view(np.uint8)
            return out.view(layout.word)

        shape = (len(devices), layout.words_per_device)
        kind = host_memory_kind(model.mesh)
        if kind is None:
            data = np.concatenate([row(i) for i in range(len(devices))])
        else:
            sharding = NamedSharding(model.mesh, row_spec(model.mesh), memory_kind=kind)
            data = jax.make_array_from_callback(shape, sharding, lambda idx: row(idx[0].start or 0))
        return cls(data, layout, model.fingerprint)


def without_weights(model: ShardedModel) -> ShardedModel:
    """`model` with its parameters replaced by ShapeDtypeStructs (same shardings), so its device copy
    can be freed once its HostWeights exist: a runner of it can only read a slot."""
    state = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding), model.state)
    return dataclasses.replace(model, state=state)


class WeightSlot:
    """A preallocated [devices, bytes_per_device / word size] buffer of `word`s on `mesh` holding the
    active model's weights, and a staging buffer for the next model's."""

    def __init__(self, mesh: Mesh, bytes_per_device: int, word: Any = np.uint32):
        if bytes_per_device < 1:
            raise ValueError(f"WeightSlot: bytes_per_device must be >= 1, got {bytes_per_device}")
        self.mesh = mesh
        self.bytes_per_device = _aligned(bytes_per_device)
        self.word = np.dtype(word)
        self.sharding = NamedSharding(mesh, row_spec(mesh))
        shape = (mesh.devices.size, self.bytes_per_device // self.word.itemsize)
        self.array: jax.Array = jax.jit(lambda: jnp.zeros(shape, self.word), out_shardings=self.sharding)()
        # In place: the slot is donated and the output pinned to its sharding, so XLA writes into its
        # buffers. (Returning `src` itself would not: JAX forwards the input array instead.)
        self._write = jax.jit(lambda slot, src: jax.lax.dynamic_update_slice(slot, src, (0, 0)),
                              donate_argnums=0, out_shardings=self.sharding)
        self.active: HostWeights | None = None  # the weights now in the slot
        self.staged: HostWeights | None = None  # the weights in (or on their way to) staging
        self._staging: jax.Array | None = None
        # Bytes copied so far, over all devices: host to device (loads and stagings) and device to
        # device (activations). A switch moves its model's layout bytes: the checkpoint's, quantized
        # weights and their scales included.
        self.h2d_bytes = 0
        self.d2d_bytes = 0

    @classmethod
    def for_layouts(cls, mesh: Mesh, layouts) -> "WeightSlot":
        """A slot just big enough for the largest of `layouts`, in the word of the first."""
        layouts = list(layouts)
        return cls(mesh, max(layout.bytes_per_device for layout in layouts), layouts[0].word)

    def check(self, layout: SlotLayout) -> None:
        """ValueError unless `layout`'s model is on this slot's mesh, in its word, and fits its bytes."""
        if layout.mesh != self.mesh:
            raise ValueError(f"{layout.name} is on mesh {dict(layout.mesh.shape)} of devices "
                             f"{[d.id for d in layout.mesh.devices.flat]}; the slot is on mesh "
                             f"{dict(self.mesh.shape)} of devices {[d.id for d in self.mesh.devices.flat]}")
        if layout.word != self.word:
            raise ValueError(f"{layout.name} is laid out in {layout.word} words; the slot holds {self.word} "
                             f"(make its layout with SlotLayout.of(model, word=slot.word))")
        if layout.bytes_per_device > self.bytes_per_device:
            raise ValueError(f"{layout.name} needs {layout.bytes_per_device} bytes per device; the weight slot "
                             f"holds {self.bytes_per_device}")

    def load(self, host: HostWeights) -> None:
        """Host-to-device straight into the slot (in place); `host` is active once this returns (the
        copy itself may still be in flight: the next step waits for it)."""
        self.check(host.layout)
        self.array = self._write(self.array, jax.device_put(host.data, self.sharding))
        self.active = host
        self.h2d_bytes += host.nbytes

    def stage(self, host: HostWeights) -> None:
        """Starts copying `host` to the staging buffer and returns at once; the active model keeps
        serving meanwhile. A previous staged copy not yet activated is dropped."""
        self.check(host.layout)
        self._staging = jax.device_put(host.data, self.sharding)
        self.staged = host
        self.h2d_bytes += host.nbytes

    def staged_ready(self) -> bool:
        """Whether the staged copy has arrived on the devices (False when nothing is staged)."""
        return self._staging is not None and self._staging.is_ready()

    def wait_staged(self) -> None:
        """Blocks until the staged copy has arrived (returns at once when nothing is staged)."""
        if self._staging is not None:
            self._staging.block_until_ready()

    def activate_staged(self) -> HostWeights:
        """Copies the staged weights into the slot device-to-device (in place) and makes them active;
        frees the staging buffer. Returns them."""
        if self._staging is None:
            raise ValueError("activate_staged: nothing is staged (call stage(host) first)")
        self.array = self._write(self.array, self._staging)
        self.d2d_bytes += self.staged.nbytes
        self.active, self.staged, self._staging = self.staged, None, None
        return self.active

    def drop_staged(self) -> None:
        """Frees the staging buffer (whatever it holds, arrived or not)."""
        self.staged, self._staging = None, None

    def require_active(self, layout: SlotLayout, fingerprint: str) -> None:
        """ValueError unless the slot holds the weights `fingerprint` laid out as `layout`: stepping
        one model over another's bytes would compute garbage without any error."""
        a = self.active
        if a is None or a.layout != layout or a.fingerprint != fingerprint:
            now = "nothing" if a is None else f"{a.name} (weights {a.fingerprint})"
            raise ValueError(f"the weight slot holds {now}, not {layout.name} (weights {fingerprint}); "
                             f"load or stage and activate it first")

    def pointers(self) -> list[int]:
        """The slot's per-shard device addresses, in device order (constant for the slot's life)."""
        return [s.data.unsafe_buffer_pointer() for s in self.array.addressable_shards]
