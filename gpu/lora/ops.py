"""``y += scaling * (x A^T) B^T`` over a batch mixing adapters and the base model.

One linear layer's adapters are stacked (``LoraWeights``): slot ``i`` has rank
``ranks[i] <= R``; rows of ``A`` and columns of ``B`` past it are padding, ignored.
``y`` may be a column slice of a wider output (a fused projection's q, k or v part),
as long as its last stride is 1. Rows whose segment uses ``BASE`` are never written.

``lora_apply_torch`` is the reference (any device, fp32 products); ``lora_apply_triton``
runs the segmented shrink and expand kernels (``kernels/triton/lora``); ``lora_apply``
takes Triton on CUDA where it imports. The worker's CPU path keeps weights rank-major
(``[R, n, K]``) and runs ``lora_apply_gathered`` (two batched matmuls for every adapter
of a decode step at once) or ``lora_apply_segments`` (two matmuls per adapter, for
segments of very different lengths), as the step's plan says (``plan.LoraPlan``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import BASE, LoraBatch

__all__ = [
    "LoraWeights",
    "lora_apply",
    "lora_apply_gathered",
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
    a: torch.Tensor,
    b: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    ranks: Sequence[int],
) -> None:
    """The CPU path, one segment at a time (few segments of many rows: prefill chunks).

    Weights are rank-major: ``a`` [R, n, K], ``b`` [R, n, N] (``b`` transposed, the
    scaling folded in), so slot ``s``'s first ``r`` ranks are the strided matrices
    ``a[:r, s]`` and ``b[:r, s]``. For each ``(slot, lo, hi)``, rows ``lo:hi`` get
    ``(x A^T) B^T``; ``ranks[slot]`` 0 leaves them alone."""
    for slot, lo, hi in segments:
        r = ranks[slot]
        if r == 0 or slot == BASE or lo == hi:
            continue
        t = torch.mm(x[lo:hi], a[:r, slot].t())  # [rows, r]
        y[lo:hi].addmm_(t, b[:r, slot])


def lora_apply_gathered(
    xg: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor
) -> None:
    """The CPU path for many segments (decode steps), every adapter in two batched
    matmuls. ``xg`` [n, M, K]: the adapter rows gathered slot by slot (padded to M);
    ``a`` [n, K, r] and ``b`` [n, r, N]: views of rank-major weights (zero past each
    slot's rank); ``y`` [rows, N]: the adapter rows' outputs, in order; ``valid`` [rows]:
    where those rows are among the n * M computed."""
    out = torch.bmm(torch.bmm(xg, a), b)  # [n, M, N]
    y.add_(out.flatten(0, 1).index_select(0, valid))


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
