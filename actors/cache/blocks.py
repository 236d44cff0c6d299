"""Names of cached KV blocks that any process can compute: the router's view of a cache.

A block is one page of a prompt. Its hash is chained: it covers the block's tokens and
the hash of the block before it, so one hash names a whole prefix, and a replica's
cache is exactly the set of its blocks' hashes (``messages.cache.CacheEvents`` says
which enter and leave). ``hashlib``, not ``hash()``: every process, of any Python,
must get the same numbers. Pure Python.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = ["ROOT_HASH", "BlockEvents", "block_hashes"]

ROOT_HASH = 0  # the "block before" the first one
_MASK = (1 << 63) - 1  # msgpack and every language's int64 carry them


def block_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """The chained hash of each full page of ``tokens`` (the page after ``parent``)."""
    out: list[int] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        data = (
            parent.to_bytes(8, "little") + array("q", tokens[start : start + page_size]).tobytes()
        )
        parent = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK
        out.append(parent)
    return out


class BlockEvents:
    """The blocks a cache stored and removed since the last ``take``, netted: a block
    stored then removed (or the other way round) counts as its last event only."""

    def __init__(self) -> None:
        self._last: dict[int, bool] = {}  # hash → stored (True) or removed (False)
        self.reset = False  # every block was dropped first (a new KV pool)

    def stored(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._last[h] = True

    def removed(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._last[h] = False

    def clear_all(self) -> None:
        self._last.clear()
        self.reset = True

    def __bool__(self) -> bool:
        return self.reset or bool(self._last)

    def take(self) -> tuple[bool, list[int], list[int]]:
        """``(reset, stored, removed)`` since the last take."""
        stored = [h for h, s in self._last.items() if s]
        removed = [h for h, s in self._last.items() if not s]
        reset, self.reset = self.reset, False
        self._last.clear()
        return reset, stored, removed
