"""``y += scaling * (x A^T) B^T`` over a batch mixing adapters and the base model.

One linear layer's adapters are stacked (``LoraWeights``): slot ``i`` has rank
``ranks[i] <= R``; rows of ``A`` and columns of ``B`` past it are padding, ignored.
``y`` may be a column slice of a wider output (a fused projection's q, k or v part),
as long as its last stride is 1. Rows whose segment uses ``BASE`` are never written.

``lora_apply_torch`` is the reference (any device, fp32 products); ``lora_apply_triton``
runs the segmented shrink and expand kernels (``kernels/triton/lora``); ``lora_apply``
takes Triton on CUDA where it imports. ``lora_apply_segments`` is the CPU path the
worker runs: the same math in the compute dtype, with the segments and ranks given as
Python lists built once per step (the batch's rows grouped so each adapter is one
segment), two matmuls per adapter and no copies of ``x`` or of the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import BASE, LoraBatch

__all__ = [
    "LoraWeights",
    "lora_apply",
    "lora_apply_segments",
    "lora_apply_torch",
    "lora_apply_triton",
]


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor  # [n, R, K]
    b: torch.Tensor  # [n, N, R]
    ranks: torch.Tensor  # [n] int32, on a's device
    scalings: torch.Tensor  # [n] float32, on a's device (PEFT: lora_alpha / r)

    def __post_init__(self) -> None:
        n, R, _ = self.a.shape
        if self.b.shape[0] != n or self.b.shape[2] != R:
            raise ValueError(f"A {tuple(self.a.shape)} and B {tuple(self.b.shape)} do not stack")
        if self.ranks.shape != (n,) or self.scalings.shape != (n,):
            raise ValueError("one rank and one scaling per adapter slot")

    @classmethod
    def stack(
        cls, adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]], rank: int = 0
    ) -> LoraWeights:
        """(A [r_i, K], B [N, r_i], scaling) per slot → stacked, zero-padded to the
        largest rank (or ``rank``)."""
        R = max([rank, *(a.shape[0] for a, _, _ in adapters)])
        a0, b0, _ = adapters[0]
        a = a0.new_zeros(len(adapters), R, a0.shape[1])
        b = b0.new_zeros(len(adapters), b0.shape[0], R)
        for i, (ai, bi, _) in enumerate(adapters):
            a[i, : ai.shape[0]] = ai
            b[i, :, : bi.shape[1]] = bi
        ranks = torch.tensor([ai.shape[0] for ai, _, _ in adapters], dtype=torch.int32)
        scalings = torch.tensor([s for _, _, s in adapters], dtype=torch.float32)
        return cls(a, b, ranks.to(a.device), scalings.to(a.device))


def lora_apply_torch(x: torch.Tensor, y: torch.Tensor, w: LoraWeights, batch: LoraBatch) -> None:
    if batch.num_rows != x.shape[0]:
        raise ValueError(f"the batch covers {batch.num_rows} rows, x has {x.shape[0]}")
    ranks, scalings = w.ranks.tolist(), w.scalings.tolist()
    bounds = batch.seg_indptr.tolist()
    for s, slot in enumerate(batch.seg_adapter.tolist()):
        lo, hi = bounds[s], bounds[s + 1]
        if slot == BASE or lo == hi:
            continue
        r = ranks[slot]
        a, b = w.a[slot, :r].float(), w.b[slot, :, :r].float()
        delta = (x[lo:hi].float() @ a.T) @ b.T
        y[lo:hi] += (scalings[slot] * delta).to(y.dtype)


def lora_apply_segments(
    x: torch.Tensor,
    y: torch.Tensor,
    w: LoraWeights,
    segments: Sequence[tuple[int, int, int]],
    ranks: Sequence[int],
    scalings: Sequence[float] | None = None,
) -> None:
    """In place on ``y``: for each ``(slot, lo, hi)``, rows ``lo:hi`` get slot's delta.
    ``ranks[slot]`` (0: the slot leaves this layer alone) and ``scalings`` (None: 1, the
    worker folds them into ``b``) are ``w.ranks`` and ``w.scalings`` as Python lists."""
    for slot, lo, hi in segments:
        r = ranks[slot]
        if r == 0 or slot == BASE or lo == hi:
            continue
        t = torch.mm(x[lo:hi], w.a[slot, :r].t())  # [n, r]
        alpha = 1.0 if scalings is None else scalings[slot]
        y[lo:hi].addmm_(t, w.b[slot, :, :r].t(), alpha=alpha)


def lora_apply_triton(x: torch.Tensor, y: torch.Tensor, w: LoraWeights, batch: LoraBatch) -> None:
    from ..attention.cuda import upload_int32
    from ..kernels.triton.lora import lora_expand, lora_shrink

    if batch.num_rows != x.shape[0]:
        raise ValueError(f"the batch covers {batch.num_rows} rows, x has {x.shape[0]}")
    lens = batch.seg_indptr[1:] - batch.seg_indptr[:-1]
    # decode steps are one row per segment: the smallest tile tl.dot takes
    block_m = 16 if lens.size == 0 or int(lens.max()) <= 16 else 64
    adapter, row, end = upload_int32(list(batch.blocks(block_m)), x.device)
    blocks = (adapter, row, end)
    tmp = lora_shrink(x, w.a, w.ranks, blocks, block_m)
    lora_expand(tmp, w.b, y, w.ranks, w.scalings, blocks, block_m)


def lora_apply(x: torch.Tensor, y: torch.Tensor, w: LoraWeights, batch: LoraBatch) -> None:
    """In place on ``y``: the kernels on CUDA (when triton imports), the reference elsewhere."""
    from ..kernels.triton import triton_available

    if x.device.type == "cuda" and triton_available():
        lora_apply_triton(x, y, w, batch)
    else:
        lora_apply_torch(x, y, w, batch)
