"""The paged KV cache: fixed-size pages of K and V for every layer.

The worker owns the tensors; which page belongs to which sequence is decided
elsewhere (the cache manager hands out page ids). Token ``t`` of a sequence
with page table ``pages`` lives in page ``pages[t // page_size]`` at offset
``t % page_size``; its flat slot is ``page * page_size + offset``.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

__all__ = ["KVPool"]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of ``shape``; on the CPU in private anonymous memory, zero by the OS's
    guarantee, each page faulted in once here by a write of one byte (1 GiB: ~0.2 s on
    a quiet 2-core Xeon; ``torch.zeros`` writes every byte, ~0.3 s there and 1-2 s of a
    restart on busy cores). Faulted in as sequences first used it instead, the pool
    cost the first requests after a start that time in the kernel (a fresh server's
    random-workload c=8 / c=32 out tok/s ~6% lower and TTFT p50 ~15% higher, alternated
    twice on the 2-core AMX Xeon); huge pages (``MADV_HUGEPAGE``) measured level there
    and compact memory first, ~1.3 s of a start."""
    count = math.prod(shape)
    if device.type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = torch.frombuffer(buf, dtype=dtype, count=count)
    out.view(torch.uint8)[:: mmap.PAGESIZE].fill_(0)  # every page resident now
    return out.view(shape)


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # One tensor so a page's K and V across all layers move with one index_select
        # (HiCache). [layers, 2 (k|v), kv_heads, pages, page_size, head_dim]
        shape = (num_layers, 2, num_kv_heads, num_pages, page_size, head_dim)
        self.kv = _zeros(shape, dtype, self.device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def k_pages(self, layer: int) -> torch.Tensor:
        """[kv_heads, pages, page_size, head_dim], a view."""
        return self.kv[layer, 0]

    def v_pages(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def k_slots(self, layer: int) -> torch.Tensor:
        """[kv_heads, pages * page_size, head_dim], a view indexed by flat slot on dim 1."""
        return self.kv[layer, 0].view(self.num_kv_heads, -1, self.head_dim)

    def v_slots(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1].view(self.num_kv_heads, -1, self.head_dim)

    def page_rows(self, layer: int) -> torch.Tensor:
        """[2 * kv_heads * pages, page_size * head_dim], a view: the page ``p`` of head
        ``h`` of K (``kv=0``) or V (``kv=1``) is row ``(kv * kv_heads + h) * pages + p``,
        so one index_select gathers a batch's K and V for every head."""
        return self.kv[layer].view(-1, self.page_size * self.head_dim)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens. slots [T] int64; k, v [T, kv_heads, head_dim]."""
        from .kernels.ops import write_kv  # a row copy a head; index_copy_ walks elements

        if write_kv(self.kv[layer], slots, k, v):
            return
        self.k_slots(layer).index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        self.v_slots(layer).index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))

    # Whole pages, for host/storage tiers. A page's data is
    # [layers, 2, kv_heads, page_size, head_dim]; several pages stack on dim 3.

    def read_pages(self, page_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """[layers, 2, kv_heads, n, page_size, head_dim], a copy."""
        idx = torch.as_tensor(page_ids, dtype=torch.long, device=self.device)
        return self.kv.index_select(3, idx)

    def write_pages(self, page_ids: list[int] | torch.Tensor, data: torch.Tensor) -> None:
        idx = torch.as_tensor(page_ids, dtype=torch.long, device=self.device)
        self.kv.index_copy_(3, idx, data.to(device=self.device, dtype=self.dtype))

    def read_pages_numpy(self, page_ids: list[int]) -> np.ndarray:
        """Like ``read_pages`` on the host; bfloat16 comes back as its raw uint16 bits."""
        data = self.read_pages(page_ids).cpu()
        if data.dtype == torch.bfloat16:
            return data.view(torch.uint16).numpy()
        return data.numpy()

    def write_pages_numpy(self, page_ids: list[int], data: np.ndarray) -> None:
        tensor = torch.from_numpy(np.ascontiguousarray(data))
        if self.dtype == torch.bfloat16 and tensor.dtype == torch.uint16:
            tensor = tensor.view(torch.bfloat16)
        self.write_pages(page_ids, tensor)
