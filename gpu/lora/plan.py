"""One step's LoRA plan: which rows use which adapter slot, and how the deltas are
computed, decided once per step and read by every LoRA layer of it.

The runner groups a step's sequences by slot (base-model rows first), so each adapter
is one segment of consecutive rows. On CUDA the Triton kernels take the segments
(``LoraBatch``). On the CPU there are two ways, chosen per step:

- ``gather``: the adapter rows gathered slot by slot into [n, M, K] (M the most rows
  any slot has, shorter slots padded) and two batched matmuls against every slot's
  weights at once: a handful of ops whatever the number of adapters. Decode steps.
- ``segments``: two matmuls per adapter on its own rows: no padding, for steps whose
  segments differ a lot in length (a long prefill beside a few decodes).

Where the native kernel builds (``kernels/lora.py``), the CPU takes neither: ``rows``
gives each row's slot and one call per projection computes every row's delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .batch import BASE, LoraBatch

__all__ = ["Gather", "LoraPlan"]

# Gather when padding computes at most this many rows per row that needs it.
MAX_PADDING = 2.0


@dataclass(frozen=True)
class Gather:
    """Where the adapter rows go in the batched matmuls."""

    index: torch.Tensor  # [n * M]: a row of x for each (slot, position); padding repeats one
    valid: torch.Tensor  # [rows]: the positions holding the adapter rows, in row order
    first: int  # rows before this one use the base model alone
    slots: slice  # the slots computed (from the lowest used to the highest)
    rows: int  # M


@dataclass(frozen=True)
class LoraPlan:
    batch: LoraBatch
    segments: list[tuple[int, int, int]]  # (slot, first row, end row), adapter rows only
    ranks: dict[str, int]  # projection → the largest rank any slot of the step has for it
    gather: Gather | None = None  # the CPU's batched path (None: segment by segment)
    triton: bool = False
    rows: torch.Tensor | None = None  # [T] int32 each row's slot: the CPU's native kernel

    @classmethod
    def build(
        cls,
        lens: Sequence[int],
        slots: Sequence[int],
        ranks: dict[str, list[int]] | None = None,
        *,
        triton: bool = False,
        native: bool = False,
        device: torch.device | str = "cpu",
    ) -> LoraPlan:
        """Sequences of ``lens`` rows using ``slots`` (grouped: base first, then by slot),
        ``ranks`` each projection's rank per slot (None: no projection is adapted);
        ``native``: the CPU's kernel computes the deltas (no gather)."""
        indptr, adapters = [0], list[int]()
        for n, slot in zip(lens, slots, strict=True):
            if adapters and adapters[-1] == slot:
                indptr[-1] += n
            else:
                adapters.append(slot)
                indptr.append(indptr[-1] + n)
        segments = [
            (slot, indptr[i], indptr[i + 1]) for i, slot in enumerate(adapters) if slot != BASE
        ]
        batch = LoraBatch(np.asarray(indptr, np.int32), np.asarray(adapters, np.int32))
        used = {slot for slot, _, _ in segments}
        top = {m: max((r[s] for s in used), default=0) for m, r in (ranks or {}).items()}
        gather = None if triton or native else _gather(segments, device)
        rows = torch.from_numpy(batch.token_adapters()) if native else None
        return cls(batch, segments, {m: r for m, r in top.items() if r}, gather, triton, rows)


def _gather(segments: list[tuple[int, int, int]], device: torch.device | str) -> Gather | None:
    if len(segments) < 2:  # one adapter: its own rows are already one matrix
        return None
    s0, s1 = segments[0][0], segments[-1][0] + 1
    rows = max(hi - lo for _, lo, hi in segments)
    first, end = segments[0][1], segments[-1][2]
    if (s1 - s0) * rows > MAX_PADDING * (end - first):
        return None
    index = np.full((s1 - s0, rows), first, np.int64)
    valid: list[int] = []
    for slot, lo, hi in segments:
        index[slot - s0, : hi - lo] = np.arange(lo, hi)
        valid.extend(range((slot - s0) * rows, (slot - s0) * rows + hi - lo))
    return Gather(
        index=torch.from_numpy(index.reshape(-1)).to(device),
        valid=torch.tensor(valid, dtype=torch.int64, device=device),
        first=first,
        slots=slice(s0, s1),
        rows=rows,
    )
