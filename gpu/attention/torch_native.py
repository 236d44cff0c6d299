"""Pure PyTorch attention over the paged KV pool: the reference backend, on any device.
The CPU default is the ``cpu`` backend, built on this one (its decodes run in a C kernel).

Per step, sequences split into two groups:

- decodes (one new token each) run as ONE batched SDPA per layer: their pages are
  gathered with a single index along the head-major pool's page axis, which
  leaves each sequence's keys contiguous per head; SDPA reads that as a strided
  [B, Hkv, pages * page_size, D] view (no second copy), padded keys masked off.
  The G query heads sharing a KV head ride in SDPA's query-length dimension
  ([B, Hkv, G, D]), so GQA needs no copy of K/V.
- prefills run one SDPA each: a fresh prompt attends causally to its own K/V
  (no gather); a chunk extending a cached prefix gathers its pages and uses a
  precomputed offset-causal mask.

Sliding windows (``meta.layer_windows``): each distinct window gets its own plan,
shared by the layers that use it. A windowed decode gathers only the pages its
window touches and masks the keys before the window inside the first of them; a
windowed prefill adds the window to its mask and gathers a cached prefix from the
window's first page. Logit soft-capping (``meta.logit_softcap``, Gemma 2) is not
something SDPA does: those layers compute the scores explicitly.

Every index tensor and mask is built in ``init_forward_metadata`` and reused by
all layers, so the per-layer Python cost is a handful of ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ..forward_meta import ForwardMeta
from .base import AttentionBackend

if TYPE_CHECKING:
    from ..kernels.step import Cascade

__all__ = ["TorchNativeBackend", "softcapped_attention"]


@dataclass
class _Prefill:
    rows: slice
    start_pos: int
    pages: torch.Tensor | None  # [P] page ids holding keys key_start..; None: fresh prompt
    mask: torch.Tensor | None  # [n, keys] bool, True = attend; None: plain causal
    key_start: int = 0  # position of the first gathered key (a window's first page)
    kernel_args: tuple[torch.Tensor, ...] = ()  # what a subclass's prefill kernel reads


@dataclass
class _Decode:
    rows: slice | torch.Tensor  # where the group's tokens sit in the packed batch
    batch: int
    table: np.ndarray  # [B, P] page ids, padded with page 0
    seq_lens: list[int]  # keys each sequence's table holds, its new token's included
    key_len: int  # the longest of them
    starts: list[int] | None = None  # first key each attends to (a window); None: all 0
    gather_rows: torch.Tensor | None = None  # [2 * Hkv * B * P] rows of KVPool.page_rows
    mask: torch.Tensor | None = None  # [B, 1, 1, key_len] bool; None when nothing is masked
    kernel_args: tuple[torch.Tensor, ...] = ()  # what a subclass's decode kernel reads
    cascade: Cascade | None = None  # rows sharing their first pages (a subclass's kernel)


@dataclass
class _Plan:
    decode: _Decode | None
    prefills: list[_Prefill]
    whole_batch: bool  # one group covers every row in order: return its output as is


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    cap: float,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA's contract (q [B, H, n, D], k/v [B, Hkv, L, D], bool mask, GQA by head
    groups) with the scores capped: ``cap * tanh(scores / cap)`` before the softmax."""
    if k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale / cap).tanh_().mul_(cap)
    if causal:
        n, L = scores.shape[-2:]
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


class TorchNativeBackend(AttentionBackend):
    supports_sliding_window: ClassVar[bool] = True
    supports_logit_softcap: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._buffer: torch.Tensor | None = None  # decode's gathered K/V, reused

    def init_forward_metadata(self, meta: ForwardMeta) -> None:
        windows = sorted(set(meta.layer_windows)) or [0]
        meta.attn = {w: self._plan(meta, w) for w in windows}

    def _plan(self, meta: ForwardMeta, window: int) -> _Plan:
        device = meta.input_ids.device
        ps = meta.page_size
        decode_idx = [i for i, n in enumerate(meta.extend_lens) if n == 1]
        decode = None
        if decode_idx:
            ends = [meta.start_pos[i] + 1 for i in decode_idx]
            firsts = [max(0, e - window) if window else 0 for e in ends]
            skip = [f // ps * ps for f in firsts]  # tokens in pages before the window
            seq_lens = [e - s for e, s in zip(ends, skip, strict=True)]
            max_len = max(seq_lens)
            table = np.zeros((len(decode_idx), -(-max_len // ps)), dtype=np.int64)
            for b, i in enumerate(decode_idx):
                pages = meta.page_tables[i][skip[b] // ps : -(-ends[b] // ps)]
                table[b, : len(pages)] = pages
            starts = [f - s for f, s in zip(firsts, skip, strict=True)]
            rows_list = [meta.row_starts[i] for i in decode_idx]
            contiguous = rows_list == list(range(rows_list[0], rows_list[0] + len(rows_list)))
            rows: slice | torch.Tensor = (
                slice(rows_list[0], rows_list[0] + len(rows_list))
                if contiguous
                else torch.tensor(rows_list, dtype=torch.long, device=device)
            )
            d = _Decode(
                rows, len(decode_idx), table, seq_lens, max_len, starts if any(starts) else None
            )
            decode = self._plan_decode(d, meta)
        prefills = []
        for i, n in enumerate(meta.extend_lens):
            if n == 1:
                continue
            prefills.append(self._plan_prefill(meta, i, window, device))
        whole = (decode is not None and not prefills and isinstance(decode.rows, slice)) or (
            decode is None and len(prefills) == 1
        )
        return _Plan(decode, prefills, whole)

    def _plan_prefill(
        self, meta: ForwardMeta, i: int, window: int, device: torch.device
    ) -> _Prefill:
        ps, n, start = meta.page_size, meta.extend_lens[i], meta.start_pos[i]
        r0, total = meta.row_starts[i], start + n
        if start == 0 and (not window or n <= window):
            return _Prefill(slice(r0, r0 + n), 0, None, None)
        # query j sits at position start + j and sees keys start + j - window < key <= start + j
        key_start = (max(0, start - window + 1) if window else 0) // ps * ps
        query = torch.arange(start, total, device=device)[:, None]
        key = torch.arange(key_start if start else 0, total, device=device)[None, :]
        mask = key <= query
        if window:
            mask &= key > query - window
        if start == 0:  # a fresh prompt longer than its window: its own k/v, masked
            return _Prefill(slice(r0, r0 + n), 0, None, mask)
        pages = meta.page_tables[i][key_start // ps : -(-total // ps)]
        page_ids = torch.tensor(pages, dtype=torch.long, device=device)
        return _Prefill(slice(r0, r0 + n), start, page_ids, mask, key_start)

    def _plan_decode(self, d: _Decode, meta: ForwardMeta) -> _Decode:
        """Add the gather rows and the padding (and window) mask ``_decode`` uses."""
        device = self.pool.device
        # K then V, head by head, sequence by sequence: (kv * Hkv + h) * pages + page
        offsets = np.arange(2 * self.num_kv_heads, dtype=np.int64) * self.pool.num_pages
        gather = (offsets[:, None] + d.table.reshape(1, -1)).reshape(-1)
        d.gather_rows = torch.from_numpy(gather).to(device)
        if min(d.seq_lens) != d.key_len or d.starts is not None:
            keys = torch.arange(d.key_len)
            mask = keys < torch.tensor(d.seq_lens)[:, None]
            if d.starts is not None:
                mask &= keys >= torch.tensor(d.starts)[:, None]
            d.mask = mask.view(d.batch, 1, 1, d.key_len).to(device)
        return d

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: ForwardMeta
    ) -> torch.Tensor:
        plan: _Plan = meta.attn[meta.window(layer)]
        pool = self.pool
        pool.write(layer, meta.out_cache_loc, k, v)
        T, H, D = q.shape
        cap = meta.logit_softcap
        out = None if plan.whole_batch else q.new_empty(T, H * D)
        if plan.decode is not None:
            res = self._decode(q, layer, plan.decode, cap)
            if out is None:
                return res
            out[plan.decode.rows] = res
        for p in plan.prefills:
            res = self._prefill(q[p.rows], k[p.rows], v[p.rows], layer, p, cap)
            if out is None:
                return res
            out[p.rows] = res
        assert out is not None
        return out

    def _decode(self, q: torch.Tensor, layer: int, d: _Decode, cap: float = 0.0) -> torch.Tensor:
        B, Hkv, D = d.batch, self.num_kv_heads, self.head_dim
        qd = q[d.rows].view(B, Hkv, -1, D)  # [B, Hkv, G, D]: the G heads of a group as G queries
        rows = self.pool.page_rows(layer)
        assert d.gather_rows is not None
        # Into a buffer reused by every layer and step: a fresh multi-MB tensor per
        # layer costs more in page faults than the copy itself.
        out_rows = self._scratch(d.gather_rows.numel() * rows.shape[1], rows)
        torch.index_select(rows, 0, d.gather_rows, out=out_rows.view(-1, rows.shape[1]))
        kv = out_rows.view(2, Hkv, B, -1, D)[:, :, :, : d.key_len]  # [2, Hkv, B, L, D]
        keys, vals = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [B, Hkv, L, D] views
        if cap:
            out = softcapped_attention(qd, keys, vals, d.mask, self.scale, cap)
        else:
            out = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=d.mask, scale=self.scale)
        return out.reshape(B, -1)  # [B, H * D]

    def _scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype:
            buf = self._buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def _gather(
        self, pages: torch.Tensor, table: torch.Tensor, batch: int, key_len: int
    ) -> torch.Tensor:
        """pages [Hkv, P, page, D], table [B, n] → keys [B, Hkv, key_len, D], a view
        of one copy: index_select on whole pages copies page-sized runs (advanced
        indexing is ~5x slower here), and SDPA reads the strided batch axis in place.
        """
        Hkv, D = self.num_kv_heads, self.head_dim
        flat = pages.index_select(1, table.view(-1)).view(Hkv, batch, -1, D)  # [Hkv, B, n*page, D]
        return flat[:, :, :key_len].transpose(0, 1)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        p: _Prefill,
        cap: float = 0.0,
    ) -> torch.Tensor:
        n, H, D = q.shape
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.pages is None:
            keys, vals = (
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
            )  # [1, Hkv, n, D]
        else:
            total = p.start_pos + n - p.key_start
            keys = self._gather(self.pool.k_pages(layer), p.pages, 1, total)  # [1, Hkv, total, D]
            vals = self._gather(self.pool.v_pages(layer), p.pages, 1, total)
        causal = p.mask is None
        if cap:
            out = softcapped_attention(qh, keys, vals, p.mask, self.scale, cap, causal=causal)
        else:
            out = F.scaled_dot_product_attention(
                qh,
                keys,
                vals,
                attn_mask=p.mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=self.num_kv_heads != H,
            )
        return out[0].transpose(0, 1).reshape(n, H * D)
