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

One host copy, not one per rank: where the pool replicates kv heads over a mesh axis (fewer kv heads
than TP ranks, or an expert axis), the host copy is split over that axis instead, on the first of
head_dim, page_size, kv_heads, layers that it divides (the gather writes the split directly; the
scatter gathers it back into the pool's sharding). Where none divides, the copy stays replicated and
a WARNING says why and what it costs.

A budget: `capacity_bytes` bounds the memory the tier's live copies hold (`HostKV.host_bytes`, summed
over the mesh's devices; `HostBudget` shares one bound among tiers); an offload that would exceed it
first evicts the least recently used copies, protected ones (`protect`) last, and raises
`HostBudgetError` only for a copy larger than the whole budget. An evicted copy's memory is freed
and `check` refuses it by name (`HostKVEvicted`). Where the backend has no host memory kind, copies
would live in device memory: they are refused unless the caller grants `device_fallback_bytes`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from talaria_jax.kvcache.pool import PoolSpec, arena_sharding, read_pages, view_sharding, write_pages


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

    def prefix_key(self, tenant: str | None = None) -> tuple:
        """The prefix-cache key of this KV for `tenant` (a cache salt): model, weights, tenant."""
        return self.model, self.weights, tenant

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
    # the tier's record of this copy (budget, LRU, eviction); shared by dataclasses.replace copies
    copy: _Copy | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def session(self) -> str | None:
        return self.copy.session if self.copy is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes of the real pages, once (no padding, no replicas)."""
        return self.data.nbytes * self.num_pages // self.data.shape[2]

    @property
    def host_bytes(self) -> int:
        """Bytes the copy really occupies, summed over the devices whose memory holds it: the padded page
        axis included, and every replica where its sharding could not split it (see HostTier)."""
        return held_bytes(self.data.sharding, self.data.shape, self.data.dtype)

    def prefix(self, n: int) -> "HostKV":
        """The KV of the first `n` tokens: a view of the same host data with fewer pages (the tier's
        record is shared), for a prompt that extends only part of this copy."""
        if not 0 < n <= self.num_tokens:
            raise ValueError(f"prefix of {n} tokens: must be in [1, {self.num_tokens}]")
        return dataclasses.replace(self, num_pages=-(-n // self.data.shape[3]), token_ids=self.token_ids[:n])

    @property
    def evicted(self) -> bool:
        """True once the tier dropped the copy to stay within its budget (the data is gone)."""
        return self.copy is not None and self.copy.gone == _EVICTED


_EVICTED, _RELEASED = "evicted", "released"


class _Copy:
    """A tier's record of one copy. The tier holds it weakly: when the last HostKV holding it goes, its
    bytes leave the budget."""

    __slots__ = ("key", "data", "session", "host_bytes", "gone", "__weakref__")

    def __init__(self, key: int, data: jax.Array, session: str | None, host_bytes: int):
        self.key, self.data, self.session, self.host_bytes = key, data, session, host_bytes
        self.gone: str | None = None  # _EVICTED or _RELEASED once its data was freed by the tier


class HostKVEvicted(ValueError):
    """A host KV copy the tier evicted to stay within its budget: its prefix must be recomputed."""


class HostBudgetError(MemoryError):
    """A copy larger than the whole budget of its tier (or the device memory granted)."""


class NoHostMemory(RuntimeError):
    """The backend has no host memory kind and no device memory was granted for copies instead."""


def host_memory_kind(mesh: Mesh) -> str | None:
    """The host memory kind the mesh's devices offer ("pinned_host" preferred), or None."""
    kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


def held_bytes(sharding, shape, dtype) -> int:
    """Bytes an array of `shape` takes summed over the devices of `sharding` (replicas included)."""
    return len(sharding.device_set) * math.prod(sharding.shard_shape(tuple(shape))) * jnp.dtype(dtype).itemsize


def _padded(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def padded_page_counts(max_pages: int) -> tuple[int, ...]:
    """Every page-axis length a copy of at most `max_pages` pages can have: powers of two up to
    the padded max_pages."""
    return tuple(1 << i for i in range(_padded(max(1, max_pages)).bit_length()))


class HostBudget:
    """The host memory that the live copies of one or more tiers may hold together: an instance's
    models share one (`HostTier(budget=...)`), so a server's bound is one number whatever it hosts.
    `capacity_bytes` None: unlimited. Copies are kept in least-recently-used order across the tiers;
    `evictions` counts the copies dropped to stay within it."""

    def __init__(self, capacity_bytes: int | None = None):
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or
                                           not isinstance(capacity_bytes, (int, np.integer)) or capacity_bytes < 0):
            raise ValueError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        self.capacity_bytes = None if capacity_bytes is None else int(capacity_bytes)
        self.evictions = 0
        # key -> (the copy, weakly; its session; its bytes; the tier that made it), least recently used first
        self.live: collections.OrderedDict[int, tuple[weakref.ref, str | None, int, int]] = collections.OrderedDict()
        self.protected: set[str | None] = set()
        self.keys = iter(range(1 << 62))

    @property
    def used_bytes(self) -> int:
        """Memory held by the live copies (`HostKV.host_bytes` each)."""
        return sum(e[2] for e in self.live.values())

    @property
    def num_copies(self) -> int:
        return len(self.live)


class HostTier:
    """Offloads and restores pages of one pool (`spec` on `mesh`) computed by the weights named by
    `model` and `weights` (a ShardedModel's name and fingerprint).

    `capacity_bytes`: the most memory the tier's live copies may hold (`HostKV.host_bytes`, summed over
    the mesh's devices); None: unlimited. `device_fallback_bytes`: where the backend has no host memory
    kind (`memory_kind` None), copies would live in device memory; they may hold at most this many bytes
    of it (the default 0 refuses every offload, so no device memory is taken silently). `budget`: a
    `HostBudget` shared with other tiers (then `capacity_bytes` is the budget's); None: one of its own."""

    def __init__(self, spec: PoolSpec, mesh: Mesh, *, model: str = "", weights: str = "",
                 capacity_bytes: int | None = None, device_fallback_bytes: int = 0, budget: HostBudget | None = None):
        for name, v in (("capacity_bytes", capacity_bytes), ("device_fallback_bytes", device_fallback_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        self.spec, self.mesh = spec, mesh
        self.source = KVSource(model, weights, spec.page_size, spec.num_layers, spec.kv_heads, spec.head_dim,
                               str(jnp.dtype(spec.dtype)))
        self.compilations = 0  # traces of gather and scatter (each is a compile): a steady workload adds none
        view = view_sharding(spec, mesh).spec  # [pages, rows, kv_heads, head_dim]
        pspec = PartitionSpec(None, None, None, *(tuple(view) + (None,) * 4)[1:4])
        self.device_sharding = NamedSharding(mesh, pspec)  # a copy sharded like the pool
        split, self.host_replicas, why = _split_spec(pspec, spec, mesh)
        if why:
            logging.warning("host KV copies of %s on mesh %s stay replicated %dx: %s (+%d bytes of host memory "
                            "per page over one copy)", model or "this pool", dict(mesh.shape), self.host_replicas,
                            why, (self.host_replicas - 1) * spec.page_bytes)
        self.transfer_sharding = NamedSharding(mesh, split)  # the copy's layout, in device memory
        self.memory_kind = host_memory_kind(mesh)  # None: "device fallback" (copies in device memory)
        self.memory_kinds = sorted({m.kind for m in mesh.devices.flat[0].addressable_memories()})
        self.host_sharding = NamedSharding(mesh, split, memory_kind=self.memory_kind) if self.memory_kind \
            else self.transfer_sharding
        self.device_fallback_bytes = int(device_fallback_bytes)
        self.budget = budget if budget is not None else HostBudget(capacity_bytes)
        if self.memory_kind is None:  # device memory: bounded by what the caller granted
            self.capacity_bytes = min(self.device_fallback_bytes, self.capacity_bytes if self.capacity_bytes is not None
                                      else self.device_fallback_bytes)
        # the two programs of a transfer (see the module docstring): `gather(pool, idx)` copies pages `idx`
        # of the pool into a compact array (sharded as `transfer_sharding`); `scatter(pool, data, idx)`
        # writes such an array into pages `idx` of the donated pool and returns it. Out-of-bounds indices
        # (`spec.num_pages`): zeros gathered, nothing scattered.
        self.gather = jax.jit(self._counted(functools.partial(_gather, spec=spec, mesh=mesh)),
                              out_shardings=self.transfer_sharding)
        self.scatter = jax.jit(self._counted(functools.partial(_scatter, spec=spec, mesh=mesh)), donate_argnums=0,
                               out_shardings=arena_sharding(mesh))

    def _counted(self, fn):
        @functools.wraps(fn)  # programs keep their names (jit(_gather)) in logs and profiles
        def traced(*args):
            self.compilations += 1  # runs at trace time only
            return fn(*args)
        return traced

    # -- the budget ---------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int | None:
        return self.budget.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int | None) -> None:
        self.budget.capacity_bytes = value

    @property
    def evictions(self) -> int:
        """Copies dropped to stay within capacity_bytes (of every tier sharing the budget)."""
        return self.budget.evictions

    @property
    def _live(self):
        return self.budget.live

    @property
    def _protected(self):
        return self.budget.protected

    @property
    def used_bytes(self) -> int:
        """Memory held by the live copies of the budget (this tier's, where it has its own)."""
        return self.budget.used_bytes

    def bytes_by_session(self) -> dict[str | None, int]:
        """used_bytes per offload session tag (None: untagged copies)."""
        out: dict[str | None, int] = {}
        for _, session, b, _ in self._live.values():
            out[session] = out.get(session, 0) + b
        return out

    def protect(self, session: str | None, flag: bool = True) -> None:
        """Whether the copies of `session` are evicted only after every unprotected copy."""
        (self._protected.add if flag else self._protected.discard)(session)

    def release(self, kv: HostKV) -> None:
        """Frees `kv`'s memory now; a later check or restore refuses it. Idempotent."""
        self._drop(kv.copy, _RELEASED) if kv.copy is not None else kv.data.delete()

    def release_all(self) -> None:
        """Frees every live copy this tier made (its weights changed: none of them could be restored again)."""
        for ref, _, _, owner in list(self._live.values()):
            if owner == id(self):
                self._drop(ref(), _RELEASED)

    def usable(self, kv: HostKV) -> bool:
        """False once `kv` was evicted, released or deleted (its data is gone)."""
        return not kv.data.is_deleted()

    def _copy_bytes(self, num_pages: int) -> int:
        shape = (self.spec.num_layers, 2, _padded(num_pages), self.spec.page_size, self.spec.kv_heads,
                 self.spec.head_dim)
        return held_bytes(self.host_sharding, shape, jnp.dtype(self.spec.dtype))

    def _victims(self, need: int) -> list:
        """The copies to evict so that `need` more bytes fit: least recently used first, protected ones
        only after every unprotected one (a protection orders eviction; it cannot make the budget
        overflow); HostBudgetError if the copy is larger than the whole budget, NoHostMemory in an
        ungranted device fallback. Nothing is evicted here: the caller evicts them once its own copy
        exists, so a copy that fails to arrive takes nobody else's place."""
        if self.memory_kind is None and self.device_fallback_bytes == 0:
            raise NoHostMemory(
                f"the {self.mesh.devices.flat[0].platform} backend offers no host memory kind (pinned_host or "
                f"unpinned_host; its devices have {self.memory_kinds}): a host KV copy would stay in device "
                f"memory; pass HostTier(device_fallback_bytes=...) to allow that")
        cap = self.capacity_bytes
        if cap is None:
            return []
        used = self.used_bytes
        if used + need <= cap:
            return []
        if need > cap:
            where = "device memory granted (device_fallback_bytes)" if self.memory_kind is None else "host budget"
            raise HostBudgetError(f"host KV copy of {need} bytes does not fit the {where} of {cap} bytes")
        victims, freed = [], 0
        entries = list(self._live.values())  # least recently used first, any tier's
        for ref, session, b, _ in sorted(entries, key=lambda e: e[1] in self._protected):  # (a stable sort)
            victims.append(ref)
            freed += b
            if used - freed + need <= cap:
                break
        return victims

    def _evict(self, victims: list) -> None:
        for ref in victims:
            self._drop(ref(), _EVICTED)
            self.budget.evictions += 1

    def _drop(self, copy: _Copy | None, why: str) -> None:
        if copy is None or copy.gone:
            return
        copy.gone = why
        copy.data.delete()
        self._forget(copy.key)

    def _forget(self, key: int) -> None:
        self._live.pop(key, None)

    def _track(self, data: jax.Array, session: str | None) -> _Copy:
        key = next(self.budget.keys)
        copy = _Copy(key, data, session, held_bytes(data.sharding, data.shape, data.dtype))
        self._live[key] = (weakref.ref(copy), session, copy.host_bytes, id(self))
        weakref.finalize(copy, self._forget, key)  # the last HostKV holding it went: its memory is free
        return copy

    def _touch(self, kv: HostKV) -> None:
        if kv.copy is not None and kv.copy.key in self._live:
            self._live.move_to_end(kv.copy.key)

    # -- copies ----------------------------------------------------------------------------------

    def warmup(self, pool, max_pages: int):
        """Compiles gather, scatter and the host copies for every padded page count a copy of up to
        `max_pages` pages can take (`padded_page_counts`); returns the donated pool, unchanged: every
        index is padding, so nothing is read from it or written to it."""
        for n in padded_page_counts(max_pages):
            idx = np.full(n, self.spec.num_pages, np.int32)
            with jax.set_mesh(self.mesh):
                host = jax.device_put(self.gather(pool, idx), self.host_sharding)
                pool = self.scatter(pool, jax.device_put(host, self.transfer_sharding), idx)
        return pool

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.spec.page_size)

    def offload(self, pool, pages: list[int], token_ids, session: str | None = None) -> HostKV:
        """Copies `pages` (holding the KV of `token_ids`, in order) to host memory; the pool is untouched.
        `session` tags the copy for `bytes_by_session` and `protect`. Where the copy does not fit
        `capacity_bytes`, the least recently used copies are evicted first (protected ones last);
        HostBudgetError for a copy larger than the budget (nothing is evicted then), NoHostMemory in an
        ungranted device fallback."""
        token_ids = tuple(int(t) for t in token_ids)
        need = self._pages_for(len(token_ids))
        if len(pages) < need:
            raise ValueError(f"{len(token_ids)} tokens need {need} pages of {self.spec.page_size}, got {len(pages)}")
        pages = list(pages[:need])
        idx = np.full(_padded(len(pages)), self.spec.num_pages, np.int32)  # padding: out of bounds, zeros
        idx[:len(pages)] = pages
        victims = self._victims(self._copy_bytes(len(pages)))
        with jax.set_mesh(self.mesh):
            dev = self.gather(pool, idx)
        data = jax.device_put(dev, self.host_sharding)
        self._evict(victims)  # only now: for a moment the budget is exceeded by this one copy
        return HostKV(data, len(pages), token_ids, self.source, self._track(data, session))

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
        expect = (self.spec.num_layers, 2, _padded(kv.num_pages), self.spec.page_size, self.spec.kv_heads,
                  self.spec.head_dim)
        shape = tuple(kv.data.shape)  # a prefix view keeps its copy's longer page axis
        if (shape[:2] + shape[3:] != expect[:2] + expect[3:] or shape[2] < expect[2]
                or kv.data.dtype != jnp.dtype(self.spec.dtype)):
            raise ValueError(f"host KV of shape {shape} {kv.data.dtype} does not fit this pool "
                             f"(expected {expect} {self.spec.dtype})")
        if kv.evicted:  # last: a copy that is otherwise fine can still be recomputed from its token_ids
            raise HostKVEvicted(f"host KV of {kv.num_tokens} tokens was evicted to stay within the host budget "
                                f"({kv.host_bytes} bytes; recompute its prefix)")
        if kv.copy is not None and kv.copy.gone == _RELEASED:
            raise ValueError("host KV was released")
        if kv.data.is_deleted():
            raise ValueError("host KV was deleted")
        self._touch(kv)

    def restore(self, pool, kv: HostKV, pages: list[int], skip: int = 0):
        """Writes `kv` into `pages` (one per stored page) of the donated pool; returns the pool. The
        first `skip` pages are not written (a prefix cache holds them already, maybe shared)."""
        self.check(kv)
        if len(pages) != kv.num_pages:
            raise ValueError(f"host KV holds {kv.num_pages} pages but {len(pages)} destination pages were given")
        if not 0 <= skip <= kv.num_pages:
            raise ValueError(f"skip={skip} must be in [0, {kv.num_pages}]")
        idx = np.full(kv.data.shape[2], self.spec.num_pages, np.int32)  # padding: out of bounds, dropped
        idx[skip:len(pages)] = pages[skip:]
        # host to device in the copy's own layout; the scatter gathers a split copy back into the pool's
        data = jax.device_put(kv.data, self.transfer_sharding)
        with jax.set_mesh(self.mesh):
            return self.scatter(pool, data, idx)


def _split_spec(pspec: PartitionSpec, spec: PoolSpec, mesh: Mesh) -> tuple[PartitionSpec, int, str]:
    """The host copy's PartitionSpec: `pspec` (the pool's, for [layers, 2, pages, page_size, kv_heads,
    head_dim]) with each mesh axis the pool replicates over added to the first of head_dim, page_size,
    kv_heads, layers it divides; and the replicas left (1: one copy) with the reason, "" if none."""
    parts = [tuple(a for a in ((p,) if isinstance(p, str) else (p or ()))) for p in pspec]
    used = {a for p in parts for a in p}
    dims = {5: ("head_dim", spec.head_dim), 3: ("page_size", spec.page_size), 4: ("kv_heads", spec.kv_heads),
            0: ("layers", spec.num_layers)}
    replicas, why = 1, []
    for axis in mesh.axis_names:
        size = mesh.shape[axis]
        if size == 1 or axis in used:
            continue
        for d, (_, n) in dims.items():
            if n % (math.prod(mesh.shape[a] for a in parts[d]) * size) == 0:
                parts[d] += (axis,)
                break
        else:
            replicas *= size
            why.append(f"{axis}={size} divides none of " + ", ".join(
                f"{name} {n}" + (f" (already split {math.prod(mesh.shape[a] for a in parts[d])} ways)"
                                 if parts[d] else "") for d, (name, n) in dims.items()))
    out = PartitionSpec(*(None if not p else p[0] if len(p) == 1 else p for p in parts))
    return out, replicas, "; ".join(why)


def _gather(pool, idx, *, spec: PoolSpec, mesh: Mesh):
    """The pages `idx` of the arena `pool` as [layers, 2, pages, page_size, kv_heads, head_dim]. Padding
    indices are out of bounds and read as zeros: no other sequence's KV leaves with the copy."""
    pages = read_pages(pool, spec, mesh, idx)
    return pages.reshape(len(idx), spec.num_layers, 2, *pages.shape[2:]).transpose(1, 2, 0, 3, 4, 5)


def _scatter(pool, data, idx, *, spec: PoolSpec, mesh: Mesh):
    """Writes a copy `data` ([layers, 2, pages, ...]) into pages `idx` of the arena (out of bounds: dropped)."""
    pages = data.transpose(2, 0, 1, 3, 4, 5).reshape(data.shape[2], 2 * spec.num_layers, *data.shape[3:])
    return write_pages(pool, spec, mesh, idx, pages)
