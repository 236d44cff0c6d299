"""The ``flashinfer`` attention backend (the CUDA default): FlashInfer's paged decode and
prefill wrappers over the KV pool's pages.

``paged_meta.flashinfer_plan`` (pure, tested on the CPU) decides per step which wrapper
runs and what its ``plan`` gets: a batch of decodes only takes the decode wrapper, any
other batch runs whole through the prefill wrapper with a causal mask aligned to the
end of each sequence's keys (extend attention; its decodes are one-query rows). Each
layer then calls ``run`` on the same plan.

The pool's per-layer pages are ``[Hkv, pages, page_size, D]``; flashinfer's HND layout
wants ``[pages, Hkv, page_size, D]``, which is the same memory with two axes swapped:
the backend hands flashinfer that view, and flashinfer reads its strides.

CUDA graphs: one decode wrapper per captured batch size (``use_cuda_graph=True``),
sharing fixed index buffers, re-planned before each replay.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..forward_meta import ForwardMeta
from .base import AttentionBackend
from .cuda import require_cuda
from .paged_meta import FlashInferPlan, flashinfer_plan

__all__ = ["FlashInferBackend"]

WORKSPACE_BYTES = 256 << 20  # flashinfer's split-KV scratch; it asks for 128 MB or more


class FlashInferBackend(AttentionBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pool = self.pool
        require_cuda("flashinfer", pool, "flashinfer", "flashinfer-python")
        if pool.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(
                f"attention backend 'flashinfer' runs fp16/bf16 KV, not {pool.dtype}; "
                "use --dtype bfloat16, or --attention-backend triton"
            )
        import flashinfer

        self._fi = flashinfer
        self._dtype = str(pool.dtype).removeprefix("torch.")
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        # tensor-core decode pays off once a KV head serves several query heads
        self._tensor_cores = self.num_heads // self.num_kv_heads >= 4
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "HND", use_tensor_cores=self._tensor_cores
        )
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND")
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def plan(self, meta: ForwardMeta) -> FlashInferPlan:
        return flashinfer_plan(
            meta, self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self._dtype
        )

    def _call_plan(self, wrapper: Any, plan: FlashInferPlan) -> None:
        # Host tensors, pinned: plan() reads indptr on the host and copies the rest over.
        args = [
            torch.from_numpy(a).pin_memory() if isinstance(a, np.ndarray) else a for a in plan.args
        ]
        wrapper.plan(*args, **plan.kwargs)

    def init_forward_metadata(self, meta: ForwardMeta) -> None:
        plan = self.plan(meta)
        wrapper = self._decode if plan.wrapper == "decode" else self._prefill
        self._call_plan(wrapper, plan)
        meta.attn = wrapper

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: ForwardMeta
    ) -> torch.Tensor:
        pool = self.pool
        pool.write(layer, meta.out_cache_loc, k, v)
        pages = (pool.k_pages(layer).transpose(0, 1), pool.v_pages(layer).transpose(0, 1))
        out = meta.attn.run(q.contiguous(), pages)  # [T, H, D]
        return out.view(q.shape[0], -1)

    # CUDA graphs

    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        device = self.pool.device
        self._graph_buffers = (
            torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            torch.zeros(max_bs * max_pages, dtype=torch.int32, device=device),
            torch.zeros(max_bs, dtype=torch.int32, device=device),
        )
        self._graph_wrappers.clear()

    def init_forward_metadata_graph(self, meta: ForwardMeta, bs: int) -> None:
        assert self._graph_buffers is not None, "init_graph_state first"
        plan = self.plan(meta)
        if plan.wrapper != "decode" or plan.kv.size != bs:
            raise ValueError(f"a graph step is {bs} decodes, got {plan.kv.q_len.tolist()}")
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            indptr, indices, last = self._graph_buffers
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "HND",
                use_cuda_graph=True,
                use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=indptr[: bs + 1],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:bs],
            )
            self._graph_wrappers[bs] = wrapper
        self._call_plan(wrapper, plan)
        meta.attn = wrapper
