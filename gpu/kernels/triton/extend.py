"""Paged extend attention: a chunk of new tokens over its cached prefix, causal in the chunk.

A fresh prefill is the case with an empty prefix. The new tokens' K and V are already
in the pool when this runs (the backend writes them first), so prefix and chunk are
read alike, through the sequence's page list; query ``j`` of a chunk over a prefix of
``p`` tokens sits at position ``p + j`` and sees keys ``0 .. p + j``.

One program per (block of ``BLOCK_M`` queries of one sequence, query head). The blocks
of a ragged batch are listed on the host (``block_seq``, ``block_start``), so the grid
holds no empty programs however uneven the chunks are. Sequence ``i``'s queries are rows
``q_start[i] ..`` of q and out ``[T, H, D]``; K and V pages ``[Hkv, pages, page_size, D]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, block_d, check_pages, precision, upcast

__all__ = ["extend_attention", "extend_blocks", "extend_kernel"]


@triton.jit
def extend_kernel(
    Q,
    K,
    V,
    Out,
    BlockSeq,
    BlockStart,
    QStart,
    QLen,
    Prefix,
    KvIndptr,
    KvIndices,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kp,
    stride_ks,
    stride_ot,
    stride_oh,
    sm_scale_log2,
    G: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    seq = tl.load(BlockSeq + blk)
    m0 = tl.load(BlockStart + blk)
    q0 = tl.load(QStart + seq)
    n = tl.load(QLen + seq)
    prefix = tl.load(Prefix + seq)
    first_page = tl.load(KvIndptr + seq)

    mi = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_live = mi < n
    d_live = d < D
    rows = (q0 + mi).to(tl.int64)
    q_mask = m_live[:, None] & d_live[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + mi
    hi = prefix + tl.minimum(m0 + BLOCK_M, n)  # the block's last query sees keys < hi
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        live = pos < hi
        page = tl.load(KvIndices + first_page + pos // PAGE, mask=live, other=0).to(tl.int64)
        slot = page * stride_kp + (pos % PAGE) * stride_ks
        kv_mask = live[:, None] & d_live[None, :]
        k = tl.load(k_head + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2  # [M, N]
        # Key 0 is in the first block and every query sees it, so no row is all -inf
        # after the first block and the running max stays finite.
        s = tl.where(live[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v.dtype)  # the probabilities in the KV dtype, as tensor cores take them
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    dst = Out + rows[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(dst, out.to(Out.dtype.element_ty), mask=q_mask)


def extend_blocks(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): the host's block list (``paged_meta.extend_schedule``) uses the
    same BLOCK_M as the launch."""
    return (64, 64) if dtype in (torch.float16, torch.bfloat16) else (32, 32)


def extend_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    out: torch.Tensor,
    block_seq: torch.Tensor,
    block_start: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    prefix: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    block_m: int,
) -> None:
    """Write ``out`` for every query of the listed sequences (all index tensors int32)."""
    check_pages(k_pages, v_pages)
    blocks = block_seq.shape[0]
    if blocks == 0:
        return
    H, D = q.shape[1], q.shape[2]
    Hkv, page_size = k_pages.shape[0], k_pages.shape[2]
    _, block_n = extend_blocks(q.dtype)
    extend_kernel[(blocks, H)](
        q,
        k_pages,
        v_pages,
        out,
        block_seq,
        block_start,
        q_start,
        q_len,
        prefix,
        kv_indptr,
        kv_indices,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        G=H // Hkv,
        PAGE=page_size,
        D=D,
        BLOCK_D=block_d(D),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=precision(q),
        UPCAST=upcast(q),
        num_warps=4 if block_m <= 32 else 8,
    )
