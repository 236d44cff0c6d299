"""Pure PyTorch attention over the paged KV pool: works on any device, the CPU default.

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

Every index tensor and mask is built in ``init_forward_metadata`` and reused by
all layers, so the per-layer Python cost is a handful of ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..forward_meta import ForwardMeta
from .base import AttentionBackend

__all__ = ["TorchNativeBackend"]


@dataclass
class _Prefill:
    rows: slice
    start_pos: int
    pages: torch.Tensor | None  # [P] page ids covering the prefix + chunk; None: fresh prompt
    mask: torch.Tensor | None  # [n, start_pos + n] bool, True = attend
    kernel_args: tuple[torch.Tensor, ...] = ()  # what a subclass's prefill kernel reads


@dataclass
class _Decode:
    rows: slice | torch.Tensor  # where the group's tokens sit in the packed batch
    batch: int
    table: np.ndarray  # [B, P] page ids, padded with page 0
    seq_lens: list[int]  # tokens each sequence attends to
    key_len: int  # the longest sequence
    gather_rows: torch.Tensor | None = None  # [2 * Hkv * B * P] rows of KVPool.page_rows
    mask: torch.Tensor | None = None  # [B, 1, 1, key_len] bool; None when no padding
    kernel_args: tuple[torch.Tensor, ...] = ()  # what a subclass's decode kernel reads


@dataclass
class _Plan:
    decode: _Decode | None
    prefills: list[_Prefill]
    whole_batch: bool  # one group covers every row in order: return its output as is


class TorchNativeBackend(AttentionBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._buffer: torch.Tensor | None = None  # decode's gathered K/V, reused

    def init_forward_metadata(self, meta: ForwardMeta) -> None:
        device = meta.input_ids.device
        ps = meta.page_size
        decode_idx = [i for i, n in enumerate(meta.extend_lens) if n == 1]
        decode = None
        if decode_idx:
            seq_lens = [meta.start_pos[i] + 1 for i in decode_idx]
            max_len = max(seq_lens)
            max_pages = -(-max_len // ps)
            table = np.zeros((len(decode_idx), max_pages), dtype=np.int64)
            for b, i in enumerate(decode_idx):
                pages = meta.page_tables[i][: -(-seq_lens[b] // ps)]
                table[b, : len(pages)] = pages
            rows_list = [meta.row_starts[i] for i in decode_idx]
            contiguous = rows_list == list(range(rows_list[0], rows_list[0] + len(rows_list)))
            rows: slice | torch.Tensor = (
                slice(rows_list[0], rows_list[0] + len(rows_list))
                if contiguous
                else torch.tensor(rows_list, dtype=torch.long, device=device)
            )
            decode = self._plan_decode(_Decode(rows, len(decode_idx), table, seq_lens, max_len))
        prefills = []
        for i, n in enumerate(meta.extend_lens):
            if n == 1:
                continue
            r0, start = meta.row_starts[i], meta.start_pos[i]
            page_ids: torch.Tensor | None = None
            causal: torch.Tensor | None = None
            if start > 0:
                total = start + n
                page_ids = torch.tensor(
                    meta.page_tables[i][: -(-total // ps)], dtype=torch.long, device=device
                )
                # query j sits at position start + j and sees keys 0 .. start + j
                causal = torch.arange(total, device=device)[None, :] <= (
                    torch.arange(n, device=device)[:, None] + start
                )
            prefills.append(
                self._plan_prefill(
                    _Prefill(slice(r0, r0 + n), start, page_ids, causal), meta.page_tables[i]
                )
            )
        whole = (decode is not None and not prefills and isinstance(decode.rows, slice)) or (
            decode is None and len(prefills) == 1
        )
        meta.attn = _Plan(decode, prefills, whole)

    def _plan_prefill(self, p: _Prefill, page_table: list[int]) -> _Prefill:
        """A subclass's hook to add what its prefill kernel reads (the torch path needs nothing)."""
        return p

    def _plan_decode(self, d: _Decode) -> _Decode:
        """Add the gather rows and the padding mask ``_decode`` uses."""
        device = self.pool.device
        # K then V, head by head, sequence by sequence: (kv * Hkv + h) * pages + page
        offsets = np.arange(2 * self.num_kv_heads, dtype=np.int64) * self.pool.num_pages
        gather = (offsets[:, None] + d.table.reshape(1, -1)).reshape(-1)
        d.gather_rows = torch.from_numpy(gather).to(device)
        if min(d.seq_lens) != d.key_len:
            lens = torch.tensor(d.seq_lens)
            mask = torch.arange(d.key_len) < lens[:, None]
            d.mask = mask.view(d.batch, 1, 1, d.key_len).to(device)
        return d

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: ForwardMeta
    ) -> torch.Tensor:
        plan: _Plan = meta.attn
        pool = self.pool
        pool.write(layer, meta.out_cache_loc, k, v)
        T, H, D = q.shape
        out = None if plan.whole_batch else q.new_empty(T, H * D)
        if plan.decode is not None:
            res = self._decode(q, layer, plan.decode)
            if out is None:
                return res
            out[plan.decode.rows] = res
        for p in plan.prefills:
            res = self._prefill(q[p.rows], k[p.rows], v[p.rows], layer, p)
            if out is None:
                return res
            out[p.rows] = res
        assert out is not None
        return out

    def _decode(self, q: torch.Tensor, layer: int, d: _Decode) -> torch.Tensor:
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
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, p: _Prefill
    ) -> torch.Tensor:
        n, H, D = q.shape
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.pages is None:
            keys, vals = (
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
            )  # [1, Hkv, n, D]
            out = F.scaled_dot_product_attention(
                qh, keys, vals, is_causal=True, scale=self.scale, enable_gqa=self.num_kv_heads != H
            )
        else:
            total = p.start_pos + n
            keys = self._gather(self.pool.k_pages(layer), p.pages, 1, total)  # [1, Hkv, total, D]
            vals = self._gather(self.pool.v_pages(layer), p.pages, 1, total)
            out = F.scaled_dot_product_attention(
                qh,
                keys,
                vals,
                attn_mask=p.mask,
                scale=self.scale,
                enable_gqa=self.num_kv_heads != H,
            )
        return out[0].transpose(0, 1).reshape(n, H * D)
