"""Paged decode attention with the keys split across programs (split-KV, flash-decoding).

One new token per sequence attends to its whole context, read from the KV pages in
place through its page list (``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, the
flashinfer-style CSR table ``attention.paged_meta`` builds). Stage 1 runs a program per
(sequence, KV head, split): the G query heads that share the KV head ride together as
the rows of one ``tl.dot`` (padded to 16), so GQA reads each key once. Each split covers
a slice of the context and leaves its normalized partial output and log-sum-exp;
stage 2 merges the splits. The number of splits is a launch argument, not a function of
the context lengths, so a captured CUDA graph replays for any lengths: each sequence
cuts its own context into that many slices, and a slice past its end writes an empty
partial (log-sum-exp -inf) that the merge ignores.

Layouts: q and out ``[T, H, D]`` (rows picked by ``rows``); K and V pages of one layer
``[Hkv, pages, page_size, D]`` (``KVPool.k_pages``), any strides but a unit last one,
the same for K and V. Scores are computed in the log2 domain (``exp2``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, block_d, check_pages, precision, upcast

__all__ = ["decode_attention", "decode_reduce_kernel", "decode_split_kernel"]


@triton.jit
def decode_split_kernel(
    Q,
    K,
    V,
    Rows,
    KvIndptr,
    KvIndices,
    KvLens,
    PartOut,
    PartLse,
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kp,
    stride_ks,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    num_splits,
    sm_scale_log2,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(Rows + b).to(tl.int64)
    kv_len = tl.load(KvLens + b)
    first_page = tl.load(KvIndptr + b)
    # whole key blocks per split, so only a sequence's last block is ragged
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kv_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    d_live = d < D
    q_mask = (g < G)[:, None] & d_live[None, :]
    q = tl.load(
        Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_kh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        live = pos < hi
        page = tl.load(KvIndices + first_page + pos // PAGE, mask=live, other=0).to(tl.int64)
        slot = page * stride_kp + (pos % PAGE) * stride_ks
        kv_mask = live[:, None] & d_live[None, :]
        k = tl.load(k_head + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2  # [G, N]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block has a live key
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        p = p.to(v.dtype)  # the probabilities in the KV dtype, as tensor cores take them
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    filled = l_i > 0  # False for a split past the sequence's end
    out = acc / tl.where(filled, l_i, 1.0)[:, None]
    lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
    part = PartOut + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
    tl.store(part, out, mask=q_mask)
    tl.store(PartLse + b * stride_lb + heads * stride_lh + split, lse, mask=g < G)


@triton.jit
def decode_reduce_kernel(
    PartOut,
    PartLse,
    Out,
    Rows,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ot,
    stride_oh,
    num_splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_live = s < num_splits
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + s, mask=s_live, other=float("-inf"))
    top = tl.max(lse, 0)  # finite: the first split always holds the first key
    w = tl.exp2(lse - top)
    parts = tl.load(
        PartOut + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_live[:, None] & (d < D)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    row = tl.load(Rows + b).to(tl.int64)
    tl.store(Out + row * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)


def decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
) -> None:
    """Write ``out[rows[b]]`` for each decode ``b``.

    q, out ``[T, H, D]``; k/v pages ``[Hkv, pages, page_size, D]``; rows, kv_lens
    ``[B]`` and kv_indptr ``[B + 1]`` int32; part_out ``[B', H, S, D]`` fp32 and part_lse
    ``[B', H, S]`` fp32 with B' >= B (scratch; S = the number of splits).
    """
    check_pages(k_pages, v_pages)
    B = rows.shape[0]
    H, D = q.shape[1], q.shape[2]
    Hkv, page_size = k_pages.shape[0], k_pages.shape[2]
    G = H // Hkv
    splits = part_out.shape[2]
    if B == 0:
        return
    bd = block_d(D)
    block_n = 64 if q.element_size() <= 2 else 32
    decode_split_kernel[(B, Hkv, splits)](
        q,
        k_pages,
        v_pages,
        rows,
        kv_indptr,
        kv_indices,
        kv_lens,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        splits,
        scale * LOG2E,
        G=G,
        BLOCK_G=max(16, triton.next_power_of_2(G)),
        PAGE=page_size,
        D=D,
        BLOCK_D=bd,
        BLOCK_N=block_n,
        PRECISION=precision(q),
        UPCAST=upcast(q),
        num_warps=4,
    )
    decode_reduce_kernel[(B, H)](
        part_out,
        part_lse,
        out,
        rows,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        splits,
        D=D,
        BLOCK_D=bd,
        BLOCK_S=triton.next_power_of_2(splits),
        num_warps=4,
    )
