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
the window touches. A bf16 pool decodes through ``cpu_step.c``'s kernel of the
same shape (``attend.h``: K and V widened as read, q and the output through fp32),
and its prompts through ``cpu_prefill.c`` (bf16 products where the CPU has them,
``flash.h``: on AMX tiles, or AVX512-BF16's dot products; on AMX CPUs head sizes the
tiles do not take run torch's flash attention, ``torch_prompts_faster``); an fp32
pool's prompts run there too, in fp32 (``flash_f32.h``); that decode kernel also
takes windows and soft-capped scores, over bf16 or fp32 pages, so capped decodes of
either pool run it (Gemma 2's decodes at batch 32 spent ~1.5 ms a layer in the torch
path's gather, cap and softmax). That kernel also attends in a
cascade (``kernels/step.py``'s ``Cascade``): decodes whose tables begin in the same pages
read them once for a chunk of rows. Anything the kernels do not
cover (other dtypes or devices, no C compiler, windowed or capped prompts) takes the
torch path. (Decode-only steps of small batches skip the backend altogether:
the fused step, ``gpu/fused_decode.py``, attends inside its one native call.)
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ..forward_meta import ForwardMeta
from ..kernels import native
from ..kernels.attention import decode_kernel, prefill_kernel, prefill_tiles
from ..kernels.step import Cascade, native_step
from .torch_native import TorchNativeBackend, _Decode, _Prefill

__all__ = ["CpuBackend", "torch_prompts_faster"]

log = logging.getLogger(__name__)


def torch_prompts_faster(flags: frozenset[str], head_dim: int, tiles: bool) -> bool:
    """Whether bf16 prompts run faster through torch's flash attention than through
    cpu_prefill.c. On AMX CPUs the kernel runs head sizes that are multiples of 64 on
    tiles when the OS grants them (``tiles``, flash_amx.h): 512 fresh tokens of the
    default model's 30 layers in ~21 ms against torch's ~37 (~12 ms since its key blocks
    grew to 256). Other head sizes there take torch's flash attention (oneDNN's bf16
    tiles) over the kernel's fp32 path: 32 ms against 80 for those 512 tokens (Xeon, 2
    cores, 2026-12-02)."""
    return "amx_bf16" in flags and not (tiles and head_dim % 64 == 0)


class CpuBackend(TorchNativeBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pool = self.pool
        cpu = pool.device.type == "cpu"
        self._bf16 = cpu and pool.dtype == torch.bfloat16
        fp32 = cpu and pool.dtype == torch.float32
        # cpu_step.c's kernel reads bf16 or fp32 pages and caps scores; q and out fp32
        lib = native_step() if self._bf16 or fp32 else None
        self._kv_kernel = None if lib is None else lib.actorlm_paged_decode_kv
        self._kernel = self._kv_kernel if self._bf16 else decode_kernel() if fp32 else None
        if self._kernel is None:
            log.info("cpu attention: decodes take the torch path (%s)", pool.dtype)
        # prompts: the kernel (bf16 on AMX tiles where the CPU has them; fp32 with its
        # rows along the vector lanes, flash_f32.h: 30 layers of a 512-token prompt of the
        # default model ~60 ms against torch's ~165, 48 tokens over 1,104 cached ~27
        # against ~95, 2-core Ice Lake)
        self._prefill_kernel = prefill_kernel() if self._bf16 or fp32 else None
        tiles = self._bf16 and self._prefill_kernel is not None and prefill_tiles()
        self._torch_prompts = self._bf16 and torch_prompts_faster(
            native.cpu_flags(), self.head_dim, tiles
        )
        # decodes whose contexts begin in the same pages read them once a chunk of rows
        # (kernels/step.py's Cascade; cpu_step.c's kernel, outside windows)
        self.cascade = True
        self._chunk_rows = Cascade.sequences(self.num_heads, self.num_kv_heads)

    def _plan_prefill(
        self, meta: ForwardMeta, i: int, window: int, device: torch.device
    ) -> _Prefill:
        p = super()._plan_prefill(meta, i, window, device)
        kernel = self._prefill_kernel is not None and not window and not meta.logit_softcap
        kernel = kernel and not self._torch_prompts
        if kernel and self.head_dim % 16 == 0 and self.head_dim <= 256:
            n = p.rows.stop - p.rows.start
            needed = -(-(p.start_pos + n) // self.pool.page_size)
            p.kernel_args = (torch.tensor(meta.page_tables[i][:needed], dtype=torch.int64),)
        return p

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        p: _Prefill,
        cap: float = 0.0,
    ) -> torch.Tensor:
        if cap or not p.kernel_args or q.stride(2) != 1 or q.stride(1) != self.head_dim:
            return super()._prefill(q, k, v, layer, p, cap)
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
            return super()._prefill(q, k, v, layer, p, cap)
        return out

    def _plan_decode(self, d: _Decode, meta: ForwardMeta) -> _Decode:
        if (self._kv_kernel if meta.logit_softcap else self._kernel) is None:
            return super()._plan_decode(d, meta)
        table = torch.from_numpy(np.ascontiguousarray(d.table))
        lens = torch.tensor(d.seq_lens, dtype=torch.int64)
        starts = None if d.starts is None else torch.tensor(d.starts, dtype=torch.int64)
        d.kernel_args = (table, lens) if starts is None else (table, lens, starts)
        kv_kernel = self._bf16 or meta.logit_softcap  # _decode's choice
        if self.cascade and kv_kernel and starts is None and self._kv_kernel is not None:
            pages = self.pool.page_size
            d.cascade = Cascade.find(table.numpy(), lens.numpy(), pages, self._chunk_rows)
        return d

    def _decode(self, q: torch.Tensor, layer: int, d: _Decode, cap: float = 0.0) -> torch.Tensor:
        kernel = self._kv_kernel if cap or self._bf16 else self._kernel
        if not d.kernel_args or kernel is None:
            return super()._decode(q, layer, d, cap)
        qd = q[d.rows]  # [B, H, D]
        if self._bf16:
            qd = qd.float()
        if qd.stride(2) != 1 or qd.stride(1) != self.head_dim:
            qd = qd.contiguous()
        table, lens = d.kernel_args[:2]
        starts = d.kernel_args[2] if len(d.kernel_args) > 2 else None
        B, H, D = d.batch, self.num_heads, self.head_dim
        out = qd.new_empty(B, H * D)
        pool = self.pool
        # cpu_step.c's kernel: a KV-dtype flag after the pages; the soft cap and the
        # cascade's rows (kernels/step.py), if any, after the scale
        kv = (int(self._bf16),) if kernel is self._kv_kernel else ()
        capped = (float(cap), *Cascade.args(d.cascade)) if kv else ()
        rc = kernel(
            qd.data_ptr(),
            qd.stride(0),
            pool.k_pages(layer).data_ptr(),
            pool.v_pages(layer).data_ptr(),
            *kv,
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
            *capped,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("cpu decode attention: out of memory for its scratch")
        return out.to(q.dtype)
