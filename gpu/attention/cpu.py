"""The CPU default: the torch backend with decodes in a C kernel over the paged pool.

The torch backend's decode gathers every sequence's K and V into one buffer and
runs SDPA on it; at batch 32 with 144-token contexts that copy and SDPA cost
~1.7 ms a layer. ``kernels/cpu_decode.c`` reads the pages in place and serves the G query
heads of a KV head from one read: ~0.9 ms, and the whole decode step at batch 32
went from ~160 to ~110 ms with the LM head change beside it (bench/forward.py).
Its scores take 8 keys at a time and its weighted sum of values keeps the
accumulators in registers, so long contexts run at the memory's speed: at batch 8
with 1,000-token contexts a decode step of the default model went from ~95 to ~65 ms.
A sliding window starts each sequence's keys at its window inside the first page
the window touches. Prefills, and anything the kernel does not cover (other
dtypes or devices, no C compiler, soft-capped scores), take the torch path.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ..forward_meta import ForwardMeta
from ..kernels.attention import decode_kernel
from .torch_native import TorchNativeBackend, _Decode

__all__ = ["CpuBackend"]

log = logging.getLogger(__name__)


class CpuBackend(TorchNativeBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pool = self.pool
        ok = pool.device.type == "cpu" and pool.dtype == torch.float32
        self._kernel = decode_kernel() if ok else None
        if self._kernel is None:
            log.info("cpu attention: decodes take the torch path (%s)", pool.dtype)

    def _plan_decode(self, d: _Decode, meta: ForwardMeta) -> _Decode:
        if self._kernel is None or meta.logit_softcap:  # the kernel does not cap scores
            return super()._plan_decode(d, meta)
        table = torch.from_numpy(np.ascontiguousarray(d.table))
        lens = torch.tensor(d.seq_lens, dtype=torch.int64)
        starts = None if d.starts is None else torch.tensor(d.starts, dtype=torch.int64)
        d.kernel_args = (table, lens) if starts is None else (table, lens, starts)
        return d

    def _decode(self, q: torch.Tensor, layer: int, d: _Decode, cap: float = 0.0) -> torch.Tensor:
        if not d.kernel_args or self._kernel is None:
            return super()._decode(q, layer, d, cap)
        qd = q[d.rows]  # [B, H, D]
        if qd.stride(2) != 1 or qd.stride(1) != self.head_dim:
            qd = qd.contiguous()
        table, lens = d.kernel_args[:2]
        starts = d.kernel_args[2] if len(d.kernel_args) > 2 else None
        B, H, D = d.batch, self.num_heads, self.head_dim
        out = q.new_empty(B, H * D)
        pool = self.pool
        rc = self._kernel(
            qd.data_ptr(),
            qd.stride(0),
            pool.k_pages(layer).data_ptr(),
            pool.v_pages(layer).data_ptr(),
            pool.num_pages,
            table.data_ptr(),
            table.shape[1],
            lens.data_ptr(),
            None if starts is None else starts.data_ptr(),
            out.data_ptr(),
            B,
            self.num_kv_heads,
            H // self.num_kv_heads,
            D,
            pool.page_size,
            d.key_len,
            self.scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("cpu decode attention: out of memory for its scratch")
        return out
