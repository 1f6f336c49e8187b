"""Paged KV: device pool, page allocator (installed as talaria_jax.kvcache)."""
from talaria_jax.kvcache.allocator import OutOfPages, PageAllocator, SequencePages
from talaria_jax.kvcache.pool import PoolSpec, allocate_pool, buffer_pointers, pool_spec

__all__ = ["OutOfPages", "PageAllocator", "PoolSpec", "SequencePages", "allocate_pool", "buffer_pointers", "pool_spec"]
