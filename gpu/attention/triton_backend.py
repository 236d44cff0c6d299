"""The ``triton`` attention backend: paged decode (split-KV) and extend/prefill kernels
(``kernels/triton``) over the KV pool's pages, in place.

Per step the batch splits as in the torch backend: sequences with one new token run
the decode kernel, the others (fresh prompts, chunks over a cached prefix) the extend
kernel; both write straight into the step's output rows, so nothing is gathered or
scattered. Their index arrays (``paged_meta``) go to the device in one copy per step,
shared by every layer.

Decode steps can be captured in CUDA graphs (``cuda_graphs``): ``init_graph_state``
allocates fixed buffers for the largest batch, and ``init_forward_metadata_graph``
refills them before each replay. The number of KV splits then depends on the batch
size alone, so one graph per size serves every context length.

On CPU tensors the kernels run in Triton's interpreter, for tests (see
``kernels/triton``); the backend accepts a CPU pool only when asked to
(``interpret=True``) and in that mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..forward_meta import ForwardMeta
from .base import AttentionBackend
from .cuda import require_cuda, upload_int32
from .paged_meta import PagedKV, extend_schedule, paged_kv, split_decodes

__all__ = ["TritonBackend", "num_kv_splits"]

MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in its merge than it saves
_ANY_LENGTH = 1 << 30


def num_kv_splits(batch: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """Enough (sequence, KV head, split) programs to fill the device twice over, each
    split at least ``MIN_SPLIT_TOKENS`` long: long contexts at small batches split,
    large batches fill the device without."""
    by_occupancy = -(-2 * num_sms // max(1, batch * num_kv_heads))
    by_length = -(-max_len // MIN_SPLIT_TOKENS)
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


@dataclass
class _Decode:
    rows: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    part_out: torch.Tensor  # [B, H, splits, D] fp32
    part_lse: torch.Tensor  # [B, H, splits] fp32


@dataclass
class _Extend:
    block_seq: torch.Tensor
    block_start: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    prefix: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


@dataclass
class _Plan:
    decode: _Decode | None
    extend: _Extend | None


@dataclass
class _GraphState:
    max_bs: int
    max_pages: int  # per sequence
    index: torch.Tensor  # device int32: rows | kv_indptr | kv_lens | kv_indices
    staging: torch.Tensor  # the same layout, pinned on the host
    partials: torch.Tensor  # fp32 scratch for the largest (batch x splits)
    copied: Any = None  # CUDA event: the last upload out of ``staging`` has run


class TritonBackend(AttentionBackend):
    def __init__(
        self, *args: Any, num_splits: int | None = None, interpret: bool = False, **kwargs: Any
    ) -> None:
        """``num_splits`` fixes the decode's KV splits (tests; else ``num_kv_splits``);
        ``interpret`` accepts a CPU pool, for tests in Triton's interpreter."""
        super().__init__(*args, **kwargs)
        require_cuda("triton", self.pool, "triton", "triton", cpu_ok=interpret)
        from ..kernels.triton import interpreted

        if self.pool.device.type == "cpu" and not interpreted():
            raise RuntimeError(
                "triton's interpreter is off in this process: set TRITON_INTERPRET=1 before "
                "triton is first imported to run its kernels on the CPU"
            )
        from ..kernels.triton.decode import decode_attention
        from ..kernels.triton.extend import extend_attention, extend_blocks

        self._decode_attention = decode_attention
        self._extend_attention = extend_attention
        self._block_m = extend_blocks(self.pool.dtype)[0]
        self._fixed_splits = num_splits
        device = self.pool.device
        self._num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4  # the interpreter: a few splits, so tests cover the merge
        )
        self._graph: _GraphState | None = None

    def _splits(self, batch: int, max_len: int = _ANY_LENGTH) -> int:
        """Split counts for a graph depend on the batch alone (``max_len`` unknown)."""
        if self._fixed_splits is not None:
            return self._fixed_splits
        return num_kv_splits(batch, self.num_kv_heads, max_len, self._num_sms)

    def _partials(
        self, batch: int, splits: int, flat: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        H, D = self.num_heads, self.head_dim
        n_out, n_lse = batch * H * splits * D, batch * H * splits
        if flat is None:
            flat = torch.empty(n_out + n_lse, dtype=torch.float32, device=self.pool.device)
        return flat[:n_out].view(batch, H, splits, D), flat[n_out : n_out + n_lse].view(
            batch, H, splits
        )

    def init_forward_metadata(self, meta: ForwardMeta) -> None:
        decodes, extends = split_decodes(meta)
        arrays: list[np.ndarray] = []
        dec = ext = None
        if decodes:
            dec = paged_kv(meta, decodes)
            arrays += [dec.q_start, dec.kv_indptr, dec.kv_indices, dec.kv_lens]
        if extends:
            ext = paged_kv(meta, extends)
            block_seq, block_start = extend_schedule(ext.q_len, self._block_m)
            arrays += [block_seq, block_start, ext.q_start, ext.q_len, ext.prefix]
            arrays += [ext.kv_indptr, ext.kv_indices]
        t = upload_int32(arrays, self.pool.device) if arrays else []
        decode = extend = None
        if dec is not None:
            splits = self._splits(dec.size, int(dec.kv_lens.max()))
            part_out, part_lse = self._partials(dec.size, splits)
            decode = _Decode(t[0], t[1], t[2], t[3], part_out, part_lse)
            t = t[4:]
        if ext is not None:
            extend = _Extend(t[0], t[1], t[2], t[3], t[4], t[5], t[6])
        meta.attn = _Plan(decode, extend)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: ForwardMeta
    ) -> torch.Tensor:
        plan: _Plan = meta.attn
        pool = self.pool
        pool.write(layer, meta.out_cache_loc, k, v)
        T, H, D = q.shape
        out = q.new_empty(T, H, D)
        kp, vp = pool.k_pages(layer), pool.v_pages(layer)
        if (d := plan.decode) is not None:
            self._decode_attention(
                q, kp, vp, out, d.rows, d.kv_indptr, d.kv_indices, d.kv_lens,
                self.scale, d.part_out, d.part_lse,
            )  # fmt: skip
        if (e := plan.extend) is not None:
            self._extend_attention(
                q, kp, vp, out, e.block_seq, e.block_start, e.q_start, e.q_len, e.prefix,
                e.kv_indptr, e.kv_indices, self.scale, self._block_m,
            )  # fmt: skip
        return out.view(T, H * D)

    # CUDA graphs: decode batches of a fixed size, buffers that never move.

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        device = self.pool.device
        n = 3 * max_bs + 1 + max_bs * max_pages
        staging = torch.zeros(n, dtype=torch.int32)
        most = max(b * self._splits(b) for b in range(1, max_bs + 1))
        self._graph = _GraphState(
            max_bs=max_bs,
            max_pages=max_pages,
            index=torch.zeros(n, dtype=torch.int32, device=device),
            staging=staging.pin_memory() if device.type == "cuda" else staging,
            partials=torch.empty(
                most * self.num_heads * (self.head_dim + 1), dtype=torch.float32, device=device
            ),
        )

    def init_forward_metadata_graph(self, meta: ForwardMeta, bs: int) -> None:
        """``meta``: ``bs`` decodes (padded by the graph runner). Refills the fixed
        buffers and points ``meta.attn`` at them; the same views at every replay."""
        g = self._graph
        assert g is not None, "init_graph_state first"
        dec: PagedKV = paged_kv(meta)
        if dec.size != bs or not bool((dec.q_len == 1).all()):
            raise ValueError(f"a graph step is {bs} decodes, got {dec.q_len.tolist()}")
        mb = g.max_bs
        if g.copied is not None:
            g.copied.synchronize()  # the last replay's upload is done with the staging buffer
        host = g.staging.numpy()
        host[:bs] = dec.q_start
        host[mb : mb + bs + 1] = dec.kv_indptr
        host[2 * mb + 1 : 2 * mb + 1 + bs] = dec.kv_lens
        nnz = dec.kv_indices.shape[0]
        if nnz > bs * g.max_pages:
            raise ValueError(f"{nnz} pages exceed the graph buffers' {bs} x {g.max_pages}")
        base = 3 * mb + 1
        host[base : base + nnz] = dec.kv_indices
        g.index[: base + nnz].copy_(g.staging[: base + nnz], non_blocking=True)
        if self.pool.device.type == "cuda":
            g.copied = torch.cuda.Event()
            g.copied.record()
        idx = g.index
        splits = self._splits(bs)
        meta.attn = _Plan(
            _Decode(
                idx[:bs],
                idx[mb : mb + bs + 1],
                idx[base:],
                idx[2 * mb + 1 : 2 * mb + 1 + bs],
                *self._partials(bs, splits, g.partials),
            ),
            None,
        )
