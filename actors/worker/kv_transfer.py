"""KV pages between workers (prefill/decode disaggregation, ``messages/kv.py``).

The sending side cuts a prefilled prompt's pages into ``KVPages`` messages of at most
``CHUNK_BYTES`` each, read out of the pool right after the forward pass that computed
them (so the prefill replica may reuse them at once). The receiving side writes pages
only for a request it was told to expect (``Expected``), and only into the pages named
then: a transfer that comes after its request ended is dropped whole.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...messages.kv import KVPages
from ...messages.step import SeqResult, SeqStep

if TYPE_CHECKING:
    from ...gpu.kv_pool import KVPool

__all__ = ["CHUNK_BYTES", "Expected", "pages_to_ship", "write_pages"]

CHUNK_BYTES = 16 * 1024 * 1024  # one message's KV at most: the next is read while this goes
PAGE_AXIS = 3  # KVPool.read_pages: [layers, 2, kv_heads, pages, page_size, head_dim]


def pages_to_ship(pool: KVPool, seq: SeqStep, result: SeqResult) -> list[KVPages]:
    """The messages carrying ``seq``'s prompt pages to ``seq.ship``'s worker; the last
    carries the token the prefill sampled."""
    ship = seq.ship
    assert ship is not None
    src = seq.page_ids[ship.start_page : ship.start_page + len(ship.page_ids)]
    if len(src) != len(ship.page_ids):
        raise ValueError(f"{seq.rid}: {len(ship.page_ids)} pages to ship, {len(src)} computed")
    per_page = pool.kv[:, :, :, :1].numel() * pool.kv.element_size()
    step = max(1, CHUNK_BYTES // per_page)
    out = []
    for lo in range(0, len(src), step):
        hi = min(lo + step, len(src))
        last = hi == len(src)
        out.append(
            KVPages(
                rid=seq.rid,
                page_ids=ship.page_ids[lo:hi],
                kv=pool.read_pages_numpy(src[lo:hi]),
                last=last,
                token_id=result.token_id if last else -1,
                logprob=result.logprob if last else None,
                top_logprobs=result.top_logprobs if last else None,
            )
        )
    return out


def write_pages(pool: KVPool, msg: KVPages) -> None:
    """Write ``msg``'s pages into the pool; ValueError when they do not fit its layout."""
    shape = list(pool.kv.shape)
    shape[PAGE_AXIS] = len(msg.page_ids)
    dtype = pool.read_pages_numpy([]).dtype  # bf16 travels as its uint16 bits
    if list(msg.kv.shape) != shape or msg.kv.dtype != dtype:
        raise ValueError(
            f"KV pages of shape {list(msg.kv.shape)} {msg.kv.dtype} do not fit this pool "
            f"({shape} {dtype}): prefill and decode replicas must run the same model and dtype"
        )
    with warnings.catch_warnings():  # read-only frame bytes: torch only reads them
        warnings.simplefilter("ignore", UserWarning)
        pool.write_pages_numpy(msg.page_ids, msg.kv)


@dataclass
class _Want:
    pages: list[int]
    got: set[int] = field(default_factory=set)


class Expected:
    """The transfers a decode worker waits for: rid → the pages it may write."""

    def __init__(self) -> None:
        self._want: dict[str, _Want] = {}

    def __len__(self) -> int:
        return len(self._want)

    def expect(self, rid: str, page_ids: list[int]) -> None:
        self._want[rid] = _Want(list(page_ids))

    def accepts(self, rid: str, page_ids: list[int]) -> bool:
        want = self._want.get(rid)
        return want is not None and set(page_ids) <= set(want.pages)

    def received(self, rid: str, page_ids: list[int]) -> None:
        self._want[rid].got.update(page_ids)

    def complete(self, rid: str) -> bool:
        """Whether every page of ``rid`` arrived; it is no longer expected either way."""
        want = self._want.pop(rid, None)
        return want is not None and want.got == set(want.pages)

    def drop(self, rids: list[str]) -> None:
        for rid in rids:
            self._want.pop(rid, None)

    def clear(self) -> None:
        self._want.clear()
