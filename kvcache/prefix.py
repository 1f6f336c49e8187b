"""Automatic prefix caching: a radix tree over token ids at page granularity.

Each node is one full page of KV: the `page_size` token ids it holds and the device page holding
their KV. A path from a root spells a token prefix, so a new prompt reuses the pages of the longest
cached run of full pages it starts with. Roots are per key -- `(model, weights fingerprint, tenant
salt)` -- so different tenants, or other weights, never share KV.

Reference counts are the allocator's: the tree holds one reference on every page it keeps, and
`match` takes one more for the caller (released with the caller's sequence). A page is thus free
to evict exactly when its refcount is 1 (only the cache holds it) and its node is a leaf (removing
an inner node would cut off the pages below it).

Eviction order, cheapest to bring back per byte first (the simulator's order): unprotected leaves
before protected ones (`protect`); within each group, pages a host copy holds (`mark_backed`: a
restore brings them back) before pages only a recompute would, and then least recently used first.
Protected entries (a session the scheduler expects back, for its `protect_kv`: a whole key, or one
token path with `protect_path`) go only when nothing else is left. Caches over one allocator (the
models sharing a KV arena) evict together in that order (`evict`): recency is counted on one clock
for all caches.

Pure Python; no JAX.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Sequence

from talaria_jax.kvcache.allocator import PageAllocator

__all__ = ["PrefixCache", "PrefixCacheStats", "evict"]

_TICK = itertools.count(1)  # recency, comparable across caches


@dataclasses.dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # tokens looked up by `match` (each call counts, after its max_tokens cap)
    hit_tokens: int = 0      # of those, tokens found cached
    inserted_pages: int = 0  # pages the tree took a reference on
    evicted_pages: int = 0   # pages `evict` freed


class _Node:
    __slots__ = ("tokens", "page", "parent", "children", "last_used", "root", "protected_until", "backed")

    def __init__(self, tokens: tuple[int, ...], page: int, parent: _Node | None, root: _Root):
        self.tokens, self.page, self.parent, self.root = tokens, page, parent, root
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0
        self.protected_until: float | None = None
        self.backed: Callable[[], bool] | None = None  # whether a host copy still holds this page's KV


class _Root:
    __slots__ = ("key", "children", "protected_until")

    def __init__(self, key: Hashable):
        self.key = key
        self.children: dict[tuple[int, ...], _Node] = {}
        self.protected_until: float | None = None


class PrefixCache:
    """A trie of full KV pages per key over a `PageAllocator`'s refcounts."""

    def __init__(self, allocator: PageAllocator, page_size: int, clock: Callable[[], float] = time.monotonic):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator, self.page_size, self.clock = allocator, page_size, clock
        self._roots: dict[Hashable, _Root] = {}
        self._num_pages = 0
        self.stats = PrefixCacheStats()

    @property
    def num_pages(self) -> int:
        """Pages the tree holds a reference on."""
        return self._num_pages

    def _chunks(self, token_ids: Sequence[int], n_pages: int):
        ps = self.page_size
        if hasattr(token_ids, "tolist"):  # a numpy or array.array: Python ints, as the tree's keys are
            token_ids = token_ids.tolist()
        for i in range(n_pages):
            yield i, tuple(token_ids[i * ps:(i + 1) * ps])

    def match(self, key: Hashable, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """The pages of the longest cached run of full pages that is a prefix of `token_ids` (at most
        `max_tokens` tokens), in token order, each incref'd for the caller (free them when done)."""
        limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
        self.stats.queried_tokens += limit
        tick = next(_TICK)
        pages: list[int] = []
        for node in self._path(key, token_ids, limit):
            node.last_used = tick
            pages.append(node.page)
        self.allocator.incref(pages)
        self.stats.hit_tokens += len(pages) * self.page_size
        return pages

    def _path(self, key: Hashable, token_ids: Sequence[int], limit: int | None = None):
        """The nodes of the longest cached run of full pages that `token_ids[:limit]` starts with."""
        root = self._roots.get(key)
        children = root.children if root is not None else {}
        n = len(token_ids) if limit is None else limit
        for _, chunk in self._chunks(token_ids, n // self.page_size):
            node = children.get(chunk)
            if node is None:
                return
            yield node
            children = node.children

    def peek(self, key: Hashable, token_ids: Sequence[int]) -> int:
        """Tokens of `token_ids` a `match` would find cached now (full pages), changing nothing."""
        return sum(1 for _ in self._path(key, token_ids)) * self.page_size

    def insert(self, key: Hashable, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Caches the full pages of a sequence: `pages[i]` holds the KV of
        `token_ids[i*page_size:(i+1)*page_size]`; only pages whose every token is in `token_ids`
        enter. The tree takes its own reference on each page it newly keeps; where the same tokens
        are cached already the existing page stays (the caller still releases its own). Returns the
        number of pages newly kept."""
        n = min(len(token_ids) // self.page_size, len(pages))
        if n == 0:
            return 0
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = _Root(key)
        tick = next(_TICK)
        parent: _Node | None = None
        children = root.children
        added = 0
        for i, chunk in self._chunks(token_ids, n):
            node = children.get(chunk)
            if node is None:
                self.allocator.incref([pages[i]])
                node = children[chunk] = _Node(chunk, pages[i], parent, root)
                added += 1
            node.last_used = tick
            parent, children = node, node.children
        self._num_pages += added
        self.stats.inserted_pages += added
        return added

    def protect(self, key: Hashable, until: float | None) -> None:
        """Keeps `key`'s pages (a session the scheduler expects back) until `until` on `clock`: they
        are evicted only when no unprotected page is left. None lifts the protection."""
        root = self._roots.get(key)
        if root is None:
            if until is None:
                return  # nothing to lift: no root is made for it
            root = self._roots[key] = _Root(key)
        root.protected_until = until
        if until is None and not root.children:
            del self._roots[key]

    def protect_path(self, key: Hashable, token_ids: Sequence[int], until: float | None) -> int:
        """Protects (None: unprotects) the cached pages of `token_ids`' longest cached prefix under
        `key` until `until`: one session's KV, leaving its key's other pages (other sessions, a shared
        system prompt's siblings) evictable as usual. Returns the tokens protected."""
        return self._set(key, token_ids, "protected_until", until)

    def mark_backed(self, key: Hashable, token_ids: Sequence[int], alive: Callable[[], bool]) -> int:
        """Marks the cached full pages of `token_ids` (a host copy's tokens) as backed by that copy while
        `alive()` says it still exists (a host budget may evict it), so they are evicted before pages
        only a recompute could bring back. Returns the tokens marked."""
        return self._set(key, token_ids, "backed", alive)

    def _set(self, key: Hashable, token_ids: Sequence[int], attr: str, value) -> int:
        nodes = list(self._path(key, token_ids))
        for node in nodes:
            setattr(node, attr, value)
        return len(nodes) * self.page_size

    def _order(self, node: _Node, now: float, tie: int) -> tuple:
        backed = node.backed is not None and node.backed()
        return self._protected(node, now), not backed, node.last_used, tie, node

    def _protected(self, node: _Node, now: float) -> bool:
        return _root_protected(node.root, now) or (node.protected_until is not None and node.protected_until > now)

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self.allocator.refcount(node.page) == 1

    def _nodes(self):
        stack = [n for r in self._roots.values() for n in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evict(self, n: int) -> int:
        """Frees up to `n` pages only the cache holds (see the module `evict`). Returns how many were freed."""
        return evict([self], n)

    def _remove(self, node: _Node) -> None:
        siblings = node.parent.children if node.parent is not None else node.root.children
        del siblings[node.tokens]
        if node.parent is None and not node.root.children and not _root_protected(node.root, self.clock()):
            del self._roots[node.root.key]  # an empty root outlives its pages only while protected
        self.allocator.free([node.page])
        self._num_pages -= 1

    def clear(self) -> None:
        """Drops every page's cache reference (e.g. when the device pool was reallocated and their
        KV is gone). Pages sequences still hold stay theirs."""
        self.allocator.free([x.page for x in self._nodes()])
        self._roots.clear()
        self._num_pages = 0


def evict(caches: Sequence[PrefixCache], n: int) -> int:
    """Frees up to `n` pages that only their cache holds, from any of `caches` (over one allocator),
    leaves first: unprotected before protected, then host-backed before not, then least recently used
    first. A page a running sequence holds (refcount > 1) is never freed, nor is any page above it.
    Returns how many were freed."""
    if n <= 0:
        return 0
    order = itertools.count()  # ties: any order, but never compare nodes
    heap = []
    for cache in caches:
        now = cache.clock()
        heap += [(*cache._order(x, now, next(order)), cache) for x in cache._nodes() if cache._evictable(x)]
    heapq.heapify(heap)
    freed = 0
    while heap and freed < n:
        *_, node, cache = heapq.heappop(heap)
        cache._remove(node)
        cache.stats.evicted_pages += 1
        freed += 1
        parent = node.parent
        if parent is not None and cache._evictable(parent):
            heapq.heappush(heap, (*cache._order(parent, cache.clock(), next(order)), cache))
    return freed


def _root_protected(root: _Root, now: float) -> bool:
    return root.protected_until is not None and root.protected_until > now
