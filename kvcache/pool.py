"""The paged KV pool: per-layer K and V pages in device buffers allocated once and donated.

Shape per layer and per K/V: [num_pages, page_size, kv_heads, head_dim], sharded over kv heads on
the instance's mesh (replicated where kv_heads does not divide by tp). The arrays are created by a
jitted zeros with pinned out_shardings and never reallocated: every step takes them donated and
returns them at the same addresses.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from talaria_jax.models.config import ModelConfig
from talaria_jax.sharding import spec_for

KV_AXES = ("pages", "page_slots", "kv_heads", "head_dim")
# Config precision names that are not jnp dtype names.
_JNP_DTYPES = {"fp8": "float8_e4m3fn"}


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        return 2 * self.num_layers * self.page_size * self.kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size


def kv_shards(spec: PoolSpec, mesh: Mesh) -> int:
    """Ways the kv heads are split on `mesh`: each device holds 1/kv_shards of every page."""
    pspec = spec_for(KV_AXES, (1, spec.page_size, spec.kv_heads, spec.head_dim), mesh)
    return mesh.shape[pspec[2]] if pspec[2] else 1


def pool_spec(cfg: ModelConfig, page_size: int, mesh: Mesh, *, num_pages: int | None = None,
              memory_bytes_per_device: int | None = None) -> PoolSpec:
    """A pool for `cfg` on `mesh` with exactly one of `num_pages` or as many pages as fit in
    `memory_bytes_per_device` (KV bytes each device may hold: a page costs a device its share of the
    kv heads, the whole page where kv heads are replicated). K/V are stored in cfg.kv_dtype."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if (num_pages is None) == (memory_bytes_per_device is None):
        raise ValueError("give exactly one of num_pages or memory_bytes_per_device")
    dtype = _JNP_DTYPES.get(cfg.kv_dtype, cfg.kv_dtype)
    spec = PoolSpec(cfg.num_layers, 1, page_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    if num_pages is None:
        per_device = spec.page_bytes // kv_shards(spec, mesh)
        num_pages = memory_bytes_per_device // per_device
        if num_pages < 1:
            raise ValueError(f"KV budget of {memory_bytes_per_device} bytes per device holds no page "
                             f"({per_device} bytes per device each)")
    if num_pages < 1:
        raise ValueError(f"num_pages must be >= 1, got {num_pages}")
    return dataclasses.replace(spec, num_pages=int(num_pages))


def pool_shardings(spec: PoolSpec, mesh: Mesh) -> tuple[tuple[NamedSharding, NamedSharding], ...]:
    shape = (spec.num_pages, spec.page_size, spec.kv_heads, spec.head_dim)
    s = NamedSharding(mesh, spec_for(KV_AXES, shape, mesh))
    return tuple((s, s) for _ in range(spec.num_layers))


def allocate_pool(spec: PoolSpec, mesh: Mesh):
    """((k, v) per layer), zeros, each array created directly in its shards."""
    shape = (spec.num_pages, spec.page_size, spec.kv_heads, spec.head_dim)
    dtype = jnp.dtype(spec.dtype)

    @functools.partial(jax.jit, out_shardings=pool_shardings(spec, mesh))
    def zeros():
        return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(spec.num_layers))

    return zeros()


def buffer_pointers(pool) -> list[int]:
    """Per-shard device addresses of every pool array (stable across donated steps)."""
    return [s.data.unsafe_buffer_pointer() for layer in pool for a in layer for s in a.addressable_shards]
