"""Host-side page allocator with reference counts, and per-sequence page tables.

The device pool (kvcache/pool.py) never moves; this object decides which of its pages a sequence
owns. Reference counts let a prefix cache share pages between sequences later.
"""
from __future__ import annotations

import collections


class OutOfPages(RuntimeError):
    """Not enough free pages; the caller preempts or waits."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh pages with refcount 1, or OutOfPages (nothing is taken then)."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is free; cannot share it")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference from each page; pages reaching zero return to the free list."""
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]


class SequencePages:
    """The pages one sequence owns, in token order: token i lives in pages[i // page_size]."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages: list[int] = []

    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(self.pages))

    def grow(self, allocator: PageAllocator, num_tokens: int) -> None:
        """Makes room for num_tokens tokens in total (OutOfPages leaves the sequence unchanged)."""
        need = self.pages_needed(num_tokens)
        if need:
            self.pages.extend(allocator.allocate(need))

    def truncate(self, allocator: PageAllocator, num_tokens: int) -> None:
        """Frees the pages past those num_tokens tokens need (a speculative step's rejected drafts)."""
        keep = -(-num_tokens // self.page_size)
        allocator.free(self.pages[keep:])
        del self.pages[keep:]

    def release(self, allocator: PageAllocator) -> None:
        allocator.free(self.pages)
        self.pages = []

    def slot(self, position: int) -> int:
        """Flat slot index (page * page_size + offset) of the token at `position`."""
        return self.pages[position // self.page_size] * self.page_size + position % self.page_size
