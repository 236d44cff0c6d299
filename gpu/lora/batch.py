"""Which adapter each row of a step's packed batch uses, as segments of consecutive rows.

The contract the LoRA kernels read: segment ``s`` covers rows ``seg_indptr[s] ..
seg_indptr[s + 1] - 1`` and uses adapter slot ``seg_adapter[s]`` (an index into the
stacked weights), or ``BASE`` (-1): those rows get the base model alone and are left
untouched. A batch is usually one segment per sequence (``from_seqs``); a per-token
index (``from_tokens``) merges runs of equal adapters. Pure numpy: tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BASE", "LoraBatch"]

BASE = -1  # the slot index of "no adapter"
_I32 = np.int32


@dataclass(frozen=True)
class LoraBatch:
    seg_indptr: np.ndarray  # [S + 1] int32
    seg_adapter: np.ndarray  # [S] int32, BASE for base-model rows

    def __post_init__(self) -> None:
        if self.seg_indptr.shape[0] != self.seg_adapter.shape[0] + 1:
            raise ValueError("seg_indptr needs one entry more than seg_adapter")
        if self.seg_indptr[0] != 0 or (np.diff(self.seg_indptr) < 0).any():
            raise ValueError("seg_indptr must start at 0 and not decrease")
        if (self.seg_adapter < BASE).any():
            raise ValueError(f"adapter slots are >= 0, or {BASE} for the base model")

    @property
    def num_rows(self) -> int:
        return int(self.seg_indptr[-1])

    @classmethod
    def from_seqs(cls, lens: Sequence[int], adapters: Sequence[int]) -> LoraBatch:
        """One segment per sequence of ``lens[i]`` rows using ``adapters[i]``."""
        indptr = np.concatenate([[0], np.cumsum(np.asarray(lens, dtype=np.int64))])
        return cls(indptr.astype(_I32), np.asarray(adapters, dtype=_I32).reshape(-1))

    @classmethod
    def from_tokens(cls, token_adapters: Sequence[int]) -> LoraBatch:
        """Segments of the runs of equal per-row adapter slots."""
        tok = np.asarray(token_adapters, dtype=_I32).reshape(-1)
        if tok.size == 0:
            return cls(np.zeros(1, _I32), np.zeros(0, _I32))
        starts = np.flatnonzero(np.concatenate([[True], tok[1:] != tok[:-1]]))
        indptr = np.concatenate([starts, [tok.size]]).astype(_I32)
        return cls(indptr, tok[starts])

    def token_adapters(self) -> np.ndarray:
        """[T] int32: each row's adapter slot (BASE for base rows)."""
        return np.repeat(self.seg_adapter, np.diff(self.seg_indptr)).astype(_I32)

    def blocks(self, block_m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(adapter, first row, segment end) int32 per block of at most ``block_m`` rows,
        over the segments that use an adapter: the kernels' grid."""
        live = self.seg_adapter != BASE
        start = self.seg_indptr[:-1][live].astype(np.int64)
        end = self.seg_indptr[1:][live].astype(np.int64)
        counts = -(-(end - start) // block_m)
        seg = np.repeat(np.arange(start.size), counts)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]) if counts.size else counts
        offset = (np.arange(int(counts.sum())) - np.repeat(first, counts)) * block_m
        adapters = self.seg_adapter[live][seg]
        return adapters.astype(_I32), (start[seg] + offset).astype(_I32), end[seg].astype(_I32)
