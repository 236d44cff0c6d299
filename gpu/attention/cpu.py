"""The CPU default: the torch backend with decodes in a C kernel over the paged pool.

The torch backend's decode gathers every sequence's K and V into one buffer and
runs SDPA on it; at batch 32 with 144-token contexts that copy and SDPA cost
~1.7 ms a layer. ``kernels/cpu_decode.c`` reads the pages in place and serves the G query
heads of a KV head from one read: ~0.9 ms, and the whole decode step at batch 32
went from ~160 to ~110 ms with the LM head change beside it (bench/forward.py).
Its scores take 8 keys at a time and its weighted sum of values keeps the
accumulators in registers, so long contexts run at the memory's speed: at batch 8
with 1,000-token contexts a decode step of the default model went from ~95 to ~65 ms.
A bf16 pool decodes through ``cpu_step.c``'s kernel of the same shape (``attend.h``:
K and V widened as read, q and the output through fp32). Prefills, and anything the
kernels do not cover (other dtypes or devices, no C compiler), take the torch path
unchanged. (Decode-only steps of small batches skip the backend altogether: the fused
step, ``gpu/fused_decode.py``, attends inside its one native call.)
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ..kernels.attention import decode_kernel, prefill_kernel
from ..kernels.step import native_step
from .torch_native import TorchNativeBackend, _Decode, _Prefill

__all__ = ["CpuBackend"]

log = logging.getLogger(__name__)


class CpuBackend(TorchNativeBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pool = self.pool
        cpu = pool.device.type == "cpu"
        self._bf16 = cpu and pool.dtype == torch.bfloat16
        if self._bf16:  # cpu_step.c reads bf16 pages; q and out go through fp32
            lib = native_step()
            self._kernel = None if lib is None else lib.actorlm_paged_decode_kv
        else:
            self._kernel = decode_kernel() if cpu and pool.dtype == torch.float32 else None
        if self._kernel is None:
            log.info("cpu attention: decodes take the torch path (%s)", pool.dtype)
        # bf16 prompts: torch's CPU flash attention runs them at ~30 GFLOP/s a core
        # (~40% of a bf16 prefill); fp32 keeps torch's path, today's exact numbers.
        self._prefill_kernel = prefill_kernel() if self._bf16 else None

    def _plan_prefill(self, p: _Prefill, page_table: list[int]) -> _Prefill:
        if self._prefill_kernel is not None and self.head_dim % 16 == 0 and self.head_dim <= 256:
            n = p.rows.stop - p.rows.start
            needed = -(-(p.start_pos + n) // self.pool.page_size)
            p.kernel_args = (torch.tensor(page_table[:needed], dtype=torch.int64),)
        return p

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, p: _Prefill
    ) -> torch.Tensor:
        if not p.kernel_args or q.stride(2) != 1 or q.stride(1) != self.head_dim:
            return super()._prefill(q, k, v, layer, p)
        (pages,) = p.kernel_args
        n, H, D = q.shape
        out = q.new_empty(n, H * D)
        pool = self.pool
        bf16 = int(q.dtype == torch.bfloat16)
        rc = self._prefill_kernel(  # type: ignore[misc]
            q.data_ptr(), q.stride(0), bf16, pool.k_pages(layer).data_ptr(),
            pool.v_pages(layer).data_ptr(), int(self._bf16), pool.num_pages, pages.data_ptr(),
            p.start_pos, n, self.num_kv_heads, H // self.num_kv_heads, D, pool.page_size,
            self.scale, out.data_ptr(), out.stride(0), bf16, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            return super()._prefill(q, k, v, layer, p)
        return out

    def _plan_decode(self, d: _Decode) -> _Decode:
        if self._kernel is None:
            return super()._plan_decode(d)
        table = torch.from_numpy(np.ascontiguousarray(d.table))
        d.kernel_args = (table, torch.tensor(d.seq_lens, dtype=torch.int64))
        return d

    def _decode(self, q: torch.Tensor, layer: int, d: _Decode) -> torch.Tensor:
        if self._kernel is None:
            return super()._decode(q, layer, d)
        qd = q[d.rows]  # [B, H, D]
        if self._bf16:
            qd = qd.float()
        if qd.stride(2) != 1 or qd.stride(1) != self.head_dim:
            qd = qd.contiguous()
        table, lens = d.kernel_args
        B, H, D = d.batch, self.num_heads, self.head_dim
        out = qd.new_empty(B, H * D)
        pool = self.pool
        kv = (1,) if self._bf16 else ()
        rc = self._kernel(
            qd.data_ptr(),
            qd.stride(0),
            pool.k_pages(layer).data_ptr(),
            pool.v_pages(layer).data_ptr(),
            *kv,
            pool.num_pages,
            table.data_ptr(),
            table.shape[1],
            lens.data_ptr(),
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
        return out.to(q.dtype)
