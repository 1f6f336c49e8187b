"""Host tier: a sequence's KV pages copied out of the donated device pool to host memory, and back.

Host copies live in host memory of the pool's own devices (``NamedSharding(..., memory_kind=
"pinned_host")``, falling back to "unpinned_host" and then to device memory where a backend lacks
them) and move with ``jax.device_put``. Transfers are two-phase, so nothing reads a buffer that a
step is about to donate:
- out: ``gather`` (jitted; the pool is read, not donated) copies the pages into one compact device
  array [layers, 2, pages, page_size, kv_heads, head_dim] sharded like the pool, and device_put moves
  it to host memory;
- in: device_put brings the copy back to device memory, and ``scatter`` (jitted; the pool donated,
  shardings pinned) writes it into the destination pages and returns the pool at the same addresses.
Page counts are padded to powers of two, so a few shapes compile: padding gathers zeros
(``mode="fill"``) and is scattered nowhere (``mode="drop"``); `warmup` compiles them all.
Each copy carries a `KVSource` (model, weights fingerprint, page layout, dtype), and `check` refuses
one from other weights: KV of the same shape from other weights would restore silently and yield
wrong tokens.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from talaria_jax.kvcache.pool import KV_AXES, PoolSpec, pool_shardings
from talaria_jax.sharding import spec_for


@dataclasses.dataclass(frozen=True)
class KVSource:
    """What a host KV copy is the KV of: the model, the weights that computed it (their fingerprint)
    and the page layout and dtype it is stored in. A restore must match it field by field."""

    model: str
    weights: str  # ShardedModel.fingerprint
    page_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    def differences(self, other: "KVSource") -> list[str]:
        """'field: ours vs theirs' for each field that differs."""
        return [f"{f.name} {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]


@dataclasses.dataclass(frozen=True)
class HostKV:
    """The KV of a sequence's first `len(token_ids)` tokens, in host memory."""

    data: jax.Array  # [layers, 2, padded pages, page_size, kv_heads, head_dim]
    num_pages: int  # real pages (the rest of the page axis is padding)
    token_ids: tuple[int, ...]  # the tokens whose KV this is, so a restore can check its prefix
    source: KVSource  # the weights and layout that produced it, so a restore can refuse another model's

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the real pages, once. Host memory holds more: the page axis is padded to a power of
        two, and where the pool replicates kv heads (fewer than TP ranks) every rank keeps a copy."""
        return self.data.nbytes * self.num_pages // self.data.shape[2]


def host_memory_kind(mesh: Mesh) -> str | None:
    """The host memory kind the mesh's devices offer ("pinned_host" preferred), or None."""
    kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


def _padded(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_page_counts(max_pages: int) -> tuple[int, ...]:
    """Every page-axis length a copy of at most `max_pages` pages can have: powers of two up to
    the padded max_pages."""
    return tuple(1 << i for i in range(_padded(max(1, max_pages)).bit_length()))


class HostTier:
    """Offloads and restores pages of one pool (`spec` on `mesh`) computed by the weights named by
    `model` and `weights` (a ShardedModel's name and fingerprint)."""

    def __init__(self, spec: PoolSpec, mesh: Mesh, *, model: str = "", weights: str = ""):
        self.spec, self.mesh = spec, mesh
        self.source = KVSource(model, weights, spec.page_size, spec.num_layers, spec.kv_heads, spec.head_dim,
                               str(jnp.dtype(spec.dtype)))
        self.compilations = 0  # traces of gather and scatter (each is a compile): a steady workload adds none
        page = spec_for(KV_AXES, (1, spec.page_size, spec.kv_heads, spec.head_dim), mesh)
        pspec = PartitionSpec(None, None, *page)
        self.device_sharding = NamedSharding(mesh, pspec)
        self.memory_kind = host_memory_kind(mesh)
        self.host_sharding = NamedSharding(mesh, pspec, memory_kind=self.memory_kind) if self.memory_kind \
            else self.device_sharding
        self._gather = jax.jit(self._counted(_gather), out_shardings=self.device_sharding)
        self._scatter = jax.jit(self._counted(_scatter), donate_argnums=0, out_shardings=pool_shardings(spec, mesh))

    def _counted(self, fn):
        @functools.wraps(fn)  # programs keep their names (jit(_gather)) in logs and profiles
        def traced(*args):
            self.compilations += 1  # runs at trace time only
            return fn(*args)
        return traced

    def warmup(self, pool, max_pages: int):
        """Compiles gather, scatter and the host copies for every padded page count a copy of up to
        `max_pages` pages can take (`padded_page_counts`); returns the donated pool, unchanged: every
        index is padding, so nothing is read from it or written to it."""
        for n in padded_page_counts(max_pages):
            idx = np.full(n, self.spec.num_pages, np.int32)
            with jax.set_mesh(self.mesh):
                host = jax.device_put(self._gather(pool, idx), self.host_sharding)
                pool = self._scatter(pool, jax.device_put(host, self.device_sharding), idx)
        return pool

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.spec.page_size)

    def offload(self, pool, pages: list[int], token_ids) -> HostKV:
        """Copies `pages` (holding the KV of `token_ids`, in order) to host memory; the pool is untouched."""
        token_ids = tuple(int(t) for t in token_ids)
        need = self._pages_for(len(token_ids))
        if len(pages) < need:
            raise ValueError(f"{len(token_ids)} tokens need {need} pages of {self.spec.page_size}, got {len(pages)}")
        pages = list(pages[:need])
        idx = np.full(_padded(len(pages)), self.spec.num_pages, np.int32)  # padding: out of bounds, zeros
        idx[:len(pages)] = pages
        with jax.set_mesh(self.mesh):
            dev = self._gather(pool, idx)
        return HostKV(jax.device_put(dev, self.host_sharding), len(pages), token_ids, self.source)

    def check(self, kv: HostKV) -> None:
        """ValueError unless `kv` was offloaded by the same weights from a pool of this one's layout and
        is still whole; a source mismatch names each field that differs."""
        diff = kv.source.differences(self.source)
        if diff:
            raise ValueError(f"host KV is of another model or layout ({'; '.join(diff)}, host KV vs this pool); "
                             f"KV of other weights would yield wrong tokens")
        need = self._pages_for(kv.num_tokens)
        if kv.num_pages != need:
            raise ValueError(f"host KV of {kv.num_tokens} tokens must hold {need} pages of {self.spec.page_size}, "
                             f"holds {kv.num_pages}")
        if kv.data.is_deleted():
            raise ValueError("host KV was deleted")
        expect = (self.spec.num_layers, 2, _padded(kv.num_pages), self.spec.page_size, self.spec.kv_heads,
                  self.spec.head_dim)
        if tuple(kv.data.shape) != expect or kv.data.dtype != jnp.dtype(self.spec.dtype):
            raise ValueError(f"host KV of shape {tuple(kv.data.shape)} {kv.data.dtype} does not fit this pool "
                             f"(expected {expect} {self.spec.dtype})")

    def restore(self, pool, kv: HostKV, pages: list[int]):
        """Writes `kv` into `pages` (one per stored page) of the donated pool; returns the pool."""
        self.check(kv)
        if len(pages) != kv.num_pages:
            raise ValueError(f"host KV holds {kv.num_pages} pages but {len(pages)} destination pages were given")
        idx = np.full(kv.data.shape[2], self.spec.num_pages, np.int32)  # padding: out of bounds, dropped
        idx[:len(pages)] = pages
        data = jax.device_put(kv.data, self.device_sharding)
        with jax.set_mesh(self.mesh):
            return self._scatter(pool, data, idx)


def _gather(pool, idx):
    # padding indices are out of bounds and read as zeros: no other sequence's KV leaves with the copy
    get = lambda a: a.at[idx].get(mode="fill", fill_value=0)
    return jnp.stack([jnp.stack([get(k), get(v)]) for k, v in pool])


def _scatter(pool, data, idx):
    return tuple((k.at[idx].set(data[l, 0], mode="drop"), v.at[idx].set(data[l, 1], mode="drop"))
                 for l, (k, v) in enumerate(pool))
