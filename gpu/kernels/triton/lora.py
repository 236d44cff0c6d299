"""Segmented LoRA: ``y[rows] += scaling[a] * (x[rows] @ A[a, :r].T) @ B[a, :, :r].T`` for
the rows of each segment that uses adapter ``a`` (rank ``r``), in two kernels.

- shrink: ``t = x @ A[a].T``, ``[T, R]`` (R the largest rank; columns past an
  adapter's own rank come out 0);
- expand: ``y += scaling[a] * t @ B[a].T`` over ``[T, N]``.

Both run one program per (block of ``BLOCK_M`` rows inside one segment, output tile).
The host lists the blocks (``lora.batch.LoraBatch.blocks``) for segments with an
adapter only, so rows of the base model are never touched and the grid holds no idle
programs. Ranks are masked in the kernels, so the padding of a stacked ``A``/``B``
beyond an adapter's rank may hold anything.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import precision, upcast

__all__ = ["lora_expand", "lora_expand_kernel", "lora_shrink", "lora_shrink_kernel"]


@triton.jit
def lora_shrink_kernel(
    X,
    A,
    Tmp,
    Ranks,
    BlockAdapter,
    BlockRow,
    BlockEnd,
    K,
    R,
    stride_xt,
    stride_an,
    stride_ar,
    stride_tt,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    blk = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_R
    adapter = tl.load(BlockAdapter + blk).to(tl.int64)
    row0 = tl.load(BlockRow + blk)
    end = tl.load(BlockEnd + blk)
    rank = tl.load(Ranks + adapter)
    rows = row0 + tl.arange(0, BLOCK_M)
    r = r0 + tl.arange(0, BLOCK_R)
    row_live = rows < end
    r_live = r < rank
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_live = kk < K
        x = tl.load(
            X + rows[:, None].to(tl.int64) * stride_xt + kk[None, :],
            mask=row_live[:, None] & k_live[None, :],
            other=0.0,
        )
        a = tl.load(
            A + adapter * stride_an + r[None, :] * stride_ar + kk[:, None],
            mask=r_live[None, :] & k_live[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]: A[a, r, k] transposed by the addressing
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)
    dst = Tmp + rows[:, None].to(tl.int64) * stride_tt + r[None, :]
    tl.store(dst, acc.to(Tmp.dtype.element_ty), mask=row_live[:, None] & (r < R)[None, :])


@triton.jit
def lora_expand_kernel(
    Tmp,
    B,
    Y,
    Ranks,
    Scalings,
    BlockAdapter,
    BlockRow,
    BlockEnd,
    N,
    R,
    stride_tt,
    stride_bn,
    stride_bo,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    blk = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    adapter = tl.load(BlockAdapter + blk).to(tl.int64)
    row0 = tl.load(BlockRow + blk)
    end = tl.load(BlockEnd + blk)
    rank = tl.load(Ranks + adapter)
    scaling = tl.load(Scalings + adapter)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_live = rows < end
    col_live = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for rr in range(0, R, BLOCK_R):
        r = rr + tl.arange(0, BLOCK_R)
        r_live = r < rank
        t = tl.load(
            Tmp + rows[:, None].to(tl.int64) * stride_tt + r[None, :],
            mask=row_live[:, None] & r_live[None, :],
            other=0.0,
        )
        b = tl.load(
            B + adapter * stride_bn + cols[None, :] * stride_bo + r[:, None],
            mask=r_live[:, None] & col_live[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_N]: B[a, n, r] transposed by the addressing
        if UPCAST:
            t, b = t.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(t, b, input_precision=PRECISION)
    mask = row_live[:, None] & col_live[None, :]
    dst = Y + rows[:, None].to(tl.int64) * stride_yt + cols[None, :]
    y = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (y + scaling * acc).to(Y.dtype.element_ty), mask=mask)


def _rank_tile(r_max: int) -> int:
    return max(16, min(64, triton.next_power_of_2(r_max)))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    ranks: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
) -> torch.Tensor:
    """x [T, K], a [n, R, K] → t [T, R] in x's dtype (rows outside the blocks: 0)."""
    T, K = x.shape
    R = a.shape[1]
    tmp = x.new_zeros(T, R)
    adapter, row, end = blocks
    if adapter.numel() == 0:
        return tmp
    if x.stride(1) != 1 or a.stride(2) != 1:
        raise ValueError("lora_shrink needs x and A contiguous in K")
    br = _rank_tile(R)
    lora_shrink_kernel[(adapter.numel(), triton.cdiv(R, br))](
        x, a, tmp, ranks, adapter, row, end, K, R,
        x.stride(0), a.stride(0), a.stride(1), tmp.stride(0),
        BLOCK_M=block_m, BLOCK_R=br, BLOCK_K=64,
        PRECISION=precision(x), UPCAST=upcast(x),
    )  # fmt: skip
    return tmp


def lora_expand(
    tmp: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
) -> None:
    """y [T, N] (a view with a unit last stride is fine) += scaling * tmp @ b[a].T."""
    N = y.shape[1]
    R = tmp.shape[1]
    adapter, row, end = blocks
    if adapter.numel() == 0:
        return
    if y.stride(1) != 1 or b.stride(2) != 1:
        raise ValueError("lora_expand needs y contiguous in N and B contiguous in r")
    bn = 64
    lora_expand_kernel[(adapter.numel(), triton.cdiv(N, bn))](
        tmp, b, y, ranks, scalings, adapter, row, end, N, R,
        tmp.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_R=_rank_tile(R),
        PRECISION=precision(tmp), UPCAST=upcast(tmp),
    )  # fmt: skip
