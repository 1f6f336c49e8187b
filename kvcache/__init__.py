"""Paged KV: device pool, page allocator, host tier, prefix cache, the session-KV owner (installed as
talaria_jax.kvcache)."""
from talaria_jax.kvcache.allocator import OutOfPages, PageAllocator, SequencePages
from talaria_jax.kvcache.host_tier import HostBudget, HostKV, HostTier, KVSource, host_memory_kind, padded_page_counts
from talaria_jax.kvcache.pool import KVArena, PoolSpec, allocate_pool, buffer_pointers, pool_spec
from talaria_jax.kvcache.prefix import PrefixCache, PrefixCacheStats
from talaria_jax.kvcache.session_kv import ModelKV, SessionKV

__all__ = ["HostBudget", "HostKV", "HostTier", "KVArena", "KVSource", "ModelKV", "OutOfPages", "PageAllocator",
           "PoolSpec", "PrefixCache", "PrefixCacheStats", "SequencePages", "SessionKV", "allocate_pool",
           "buffer_pointers", "host_memory_kind", "padded_page_counts", "pool_spec"]
