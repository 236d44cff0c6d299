"""What the CUDA attention backends (``triton``, ``flashinfer``) share: the check that
they can run here, and one upload per step of their index arrays.

Both read the same KV pool as the CPU backends (head-major pages, ``KVPool.k_pages``):
the Triton kernels take its strides, and flashinfer's HND layout is the same pages
with the head and page axes swapped (a view; flashinfer reads strides too).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from ..kv_pool import KVPool

__all__ = ["require_cuda", "upload_int32"]


def require_cuda(
    name: str, pool: KVPool, module: str, pip_name: str, *, cpu_ok: bool = False
) -> None:
    """Refuse, with what to do instead, a pool this backend cannot run on."""
    on_cuda = pool.device.type == "cuda" and torch.cuda.is_available()
    if not on_cuda and not (cpu_ok and pool.device.type == "cpu"):
        raise RuntimeError(
            f"attention backend {name!r} needs a CUDA device, but the KV pool is on "
            f"{pool.device}; use --attention-backend torch on this machine"
        )
    if importlib.util.find_spec(module) is None:
        raise RuntimeError(f"attention backend {name!r} needs `pip install {pip_name}`")


def upload_int32(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays as int32 tensors on ``device``: one pinned host buffer and one
    non-blocking copy for all of them (a step has ~10 small index arrays, and each
    pageable copy would wait for the device)."""
    sizes = [int(a.size) for a in arrays]
    host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int32))
    if device.type == "cuda":
        # pin_memory() comes from torch's caching host allocator, which keeps the block
        # alive until the copy that reads it has run.
        host = host.pin_memory().to(device, non_blocking=True)
    return list(host.split(sizes))
