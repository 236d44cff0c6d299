"""Page tables of a ragged batch as CSR index arrays: the one description the CUDA
backends plan from. Pure numpy (no torch, no flashinfer), so the CPU suite checks it
against the torch backend's view of the same batch.

A group of sequences (the whole batch, or its decodes, or its extends) becomes
flashinfer's paged-KV form: sequence ``i`` of the group holds ``kv_lens[i]`` tokens in
pages ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``, the last one filled to
``kv_last_page_len[i]`` (1 .. page_size); its new tokens are rows ``q_start[i] ..
q_start[i] + q_len[i] - 1`` of the packed batch, after ``prefix[i]`` cached ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

__all__ = [
    "BatchView",
    "FlashInferPlan",
    "PagedKV",
    "extend_schedule",
    "flashinfer_plan",
    "paged_kv",
    "split_decodes",
]

_I32 = np.int32


class BatchView(Protocol):
    """The host-side fields of ``ForwardMeta`` this module reads."""

    start_pos: list[int]
    extend_lens: list[int]
    row_starts: list[int]
    page_tables: list[list[int]]
    page_size: int


@dataclass(frozen=True)
class PagedKV:
    seqs: np.ndarray  # [n] positions of the group's sequences in the batch
    q_start: np.ndarray  # [n] int32
    q_len: np.ndarray  # [n] int32
    prefix: np.ndarray  # [n] int32
    kv_indptr: np.ndarray  # [n + 1] int32
    kv_indices: np.ndarray  # [kv_indptr[-1]] int32
    kv_last_page_len: np.ndarray  # [n] int32

    @property
    def size(self) -> int:
        return int(self.seqs.shape[0])

    @property
    def kv_lens(self) -> np.ndarray:
        return (self.prefix + self.q_len).astype(_I32)

    @property
    def qo_indptr(self) -> np.ndarray:
        """[n + 1] int32 offsets of each sequence's queries among the group's rows."""
        return np.concatenate([[0], np.cumsum(self.q_len)]).astype(_I32)

    def pages(self, i: int) -> np.ndarray:
        return self.kv_indices[self.kv_indptr[i] : self.kv_indptr[i + 1]]


def paged_kv(batch: BatchView, seqs: Sequence[int] | None = None) -> PagedKV:
    """The CSR description of ``seqs`` (default: every sequence, in batch order).

    Lists first, numpy once per array: a numpy call per sequence cost ~2 us each, which
    a batch of 256 decodes (a CUDA graph replay's refill) paid every step."""
    ps = batch.page_size
    idx = range(len(batch.extend_lens)) if seqs is None else [int(i) for i in seqs]
    prefix = [batch.start_pos[i] for i in idx]
    q_len = [batch.extend_lens[i] for i in idx]
    npages = [-(-(a + n) // ps) for a, n in zip(prefix, q_len, strict=True)]
    for i, n in zip(idx, npages, strict=True):
        if len(batch.page_tables[i]) < n:
            have = len(batch.page_tables[i])
            raise ValueError(f"sequence {i}: page table of {have} pages is short of {n}")
    indptr = np.zeros(len(npages) + 1, dtype=_I32)
    np.cumsum(npages, out=indptr[1:])
    pages: list[int] = []
    for i, n in zip(idx, npages, strict=True):
        pages += batch.page_tables[i][:n]
    prefix_a, q_len_a = np.asarray(prefix, dtype=_I32), np.asarray(q_len, dtype=_I32)
    return PagedKV(
        seqs=np.asarray(idx, dtype=_I32),
        q_start=np.asarray([batch.row_starts[i] for i in idx], dtype=_I32),
        q_len=q_len_a,
        prefix=prefix_a,
        kv_indptr=indptr,
        kv_indices=np.asarray(pages, dtype=_I32),
        kv_last_page_len=((prefix_a + q_len_a - 1) % ps + 1).astype(_I32),
    )


def split_decodes(batch: BatchView) -> tuple[list[int], list[int]]:
    """(sequences with one new token, the others), each in batch order."""
    decodes = [i for i, n in enumerate(batch.extend_lens) if n == 1]
    extends = [i for i, n in enumerate(batch.extend_lens) if n != 1]
    return decodes, extends


def extend_schedule(q_len: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """One (sequence in the group, first query) pair per block of ``block_m`` queries."""
    counts = -(-q_len.astype(np.int64) // block_m)
    seq = np.repeat(np.arange(q_len.shape[0]), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]) if counts.size else counts
    start = (np.arange(int(counts.sum())) - np.repeat(first, counts)) * block_m
    return seq.astype(_I32), start.astype(_I32)


@dataclass(frozen=True)
class FlashInferPlan:
    """Which flashinfer wrapper a step runs and what its ``plan`` is called with.

    A batch of decodes only takes the decode wrapper; anything else runs the whole
    batch, decodes included, through the prefill wrapper (``causal=True``: flashinfer
    aligns the causal mask to the end of the keys, which is extend attention), so no
    row is gathered or scattered. ``args`` are ``plan``'s positional arguments (arrays
    as int32 numpy), ``kwargs`` its keywords (dtypes by name).
    """

    wrapper: Literal["decode", "prefill"]
    kv: PagedKV
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def flashinfer_plan(
    batch: BatchView,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    dtype: str,
) -> FlashInferPlan:
    kv = paged_kv(batch)
    if kv.size and not np.array_equal(kv.q_start, kv.qo_indptr[:-1]):
        raise ValueError("rows are not packed in sequence order")
    shape = (num_heads, num_kv_heads, head_dim, batch.page_size)
    kwargs: dict[str, Any] = {"q_data_type": dtype, "kv_data_type": dtype, "sm_scale": scale}
    pages = (kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len)
    if kv.size and bool((kv.q_len == 1).all()):
        return FlashInferPlan("decode", kv, (*pages, *shape), kwargs)
    return FlashInferPlan("prefill", kv, (kv.qo_indptr, *pages, *shape), {**kwargs, "causal": True})
