"""A ragged paged step for the attention-backend tests: fresh prompts, chunks over a
cached prefix and decodes in one batch, on a pool whose pages are handed out shuffled."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from actorlm.gpu.forward_meta import ForwardMeta, SeqSpec
from actorlm.gpu.kv_pool import KVPool

__all__ = ["MIXED", "Step", "ragged_step", "rebuild"]

# (tokens already cached, new tokens): prefill, decode, extend, a one-token prompt,
# decodes at and past a page edge, a long extend, a decode over a long context
MIXED = [(0, 20), (5, 1), (40, 7), (0, 1), (15, 1), (16, 1), (33, 30), (150, 1)]


@dataclass
class Step:
    pool: KVPool
    meta: ForwardMeta
    q: torch.Tensor  # [T, H, D], strided as the model hands it over
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor


def ragged_step(
    spans: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Step:
    torch.manual_seed(seed)
    need = [-(-(start + n) // page_size) for start, n in spans]
    pool = KVPool(2, sum(need) + 3, page_size, kv_heads, dim, dtype, device)
    pool.kv.normal_()
    pages = list(range(pool.num_pages))
    random.Random(seed).shuffle(pages)
    seqs, at = [], 0
    for (start, n), k in zip(spans, need, strict=True):
        seqs.append(SeqSpec([1] * n, start, pages[at : at + k]))
        at += k
    meta = ForwardMeta.build(seqs, page_size, device)
    T = meta.num_tokens
    # q as the model hands it over: the first H heads of a [T, H + Hkv, D] RoPE output
    q = torch.randn(T, heads + kv_heads, dim, device=device).to(dtype)[:, :heads]
    k = torch.randn(T, kv_heads, dim, device=device).to(dtype)
    v = torch.randn(T, kv_heads, dim, device=device).to(dtype)
    return Step(pool, meta, q, k, v)


def rebuild(step: Step) -> ForwardMeta:
    """A fresh ForwardMeta of the same step (each backend keeps its plan in ``meta.attn``)."""
    m = step.meta
    seqs = [
        SeqSpec([1] * n, s, t)
        for s, n, t in zip(m.start_pos, m.extend_lens, m.page_tables, strict=True)
    ]
    return ForwardMeta.build(seqs, m.page_size, m.input_ids.device)
