"""KV page allocator: hands out page ids; the KV tensors themselves live in the worker.

Pure Python (no asyncio, zmq or torch) so the cache manager's policy can be tested
and replaced on its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["PageAllocator", "PageAllocatorError"]


class PageAllocatorError(ValueError):
    """A page was freed twice, or an id outside ``0..num_pages-1`` was given."""


class PageAllocator:
    """Page ids ``0..num_pages-1``; ``alloc`` is all-or-nothing.

    Freed pages go to the back of the free list, so a page just released (whose
    KV may still be read by an in-flight step elsewhere) is the last to be reused.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        # One byte per page: O(1) double-free and foreign-id checks without a set of ints.
        self._in_use = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` distinct free page ids, or None (and nothing taken) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._in_use[p] = 1
        return pages

    def free(self, page_ids: Iterable[int]) -> None:
        """Return pages; raises (and frees none of them) on a foreign id or a double free."""
        pages = list(page_ids)
        seen: set[int] = set()
        for p in pages:
            if not isinstance(p, int) or not 0 <= p < self.num_pages:
                raise PageAllocatorError(f"page id {p!r} is not in 0..{self.num_pages - 1}")
            if not self._in_use[p] or p in seen:
                raise PageAllocatorError(f"page {p} freed twice (it is not allocated)")
            seen.add(p)
        for p in pages:
            self._in_use[p] = 0
        self._free.extend(pages)

    def is_free(self, page_id: int) -> bool:
        if not 0 <= page_id < self.num_pages:
            raise PageAllocatorError(f"page id {page_id!r} is not in 0..{self.num_pages - 1}")
        return not self._in_use[page_id]

    def free_page_ids(self) -> list[int]:
        """A snapshot of the free ids (for invariant checks and debugging)."""
        return list(self._free)

    def reset(self) -> None:
        """Mark every page free (after the worker's KV pool is rebuilt)."""
        self._free = deque(range(self.num_pages))
        self._in_use = bytearray(self.num_pages)
