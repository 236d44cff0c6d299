"""CUDA-only attention backends, behind lazy registry names so CPU processes never
import flashinfer or triton. Asking for one without a CUDA device fails at
construction with a message saying what to use instead.

Their kernels are not written yet: on CUDA they run the torch reference path (so
a platform that picks "flashinfer" by default still serves) and say so once. The
CPU pool is head-major ([Hkv, pages, page_size, D] per layer, ``KVPool.k_pages``),
which flashinfer's paged kernels do not read: a real backend also brings a pool
in flashinfer's layout (the platform's ``kv_pool_class``) besides replacing
``init_forward_metadata`` (plan) and ``forward`` (run).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from ..kv_pool import KVPool
from .torch_native import TorchNativeBackend

__all__ = ["FlashInferBackend", "TritonBackend"]

log = logging.getLogger(__name__)


class _CudaBackend(TorchNativeBackend):
    name = ""
    module = ""
    pip_name = ""

    def __init__(
        self, pool: KVPool, num_heads: int, head_dim: int, scale: float | None = None
    ) -> None:
        if pool.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(
                f"attention backend {self.name!r} needs a CUDA device, but the KV pool is on "
                f"{pool.device}; use --attention-backend torch on this machine"
            )
        if importlib.util.find_spec(self.module) is None:
            raise RuntimeError(
                f"attention backend {self.name!r} needs `pip install {self.pip_name}`"
            )
        log.warning(
            "attention backend %r: kernels not wired yet, running the torch reference path",
            self.name,
        )
        super().__init__(pool, num_heads, head_dim, scale)


class FlashInferBackend(_CudaBackend):
    name = "flashinfer"
    module = "flashinfer"
    pip_name = "flashinfer-python"


class TritonBackend(_CudaBackend):
    name = "triton"
    module = "triton"
    pip_name = "triton"
