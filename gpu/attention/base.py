"""The attention-backend interface (names as SGLang's).

A backend is built once per worker over the KV pool. Each step the runner calls
``init_forward_metadata(meta)`` once (index tensors, masks, kernel plans) and the
model then calls ``forward(q, k, v, layer, meta)`` in every layer, which stores
the new K/V in the pool and returns the attention output. ``scale`` is the
model's softmax scale (Gemma's is not ``head_dim ** -0.5``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from ..forward_meta import ForwardMeta
from ..kv_pool import KVPool

__all__ = ["AttentionBackend"]


class AttentionBackend(ABC):
    # What a backend honours of the model's attention layout in ``ForwardMeta``
    # (``layer_windows``, ``logit_softcap``); the runner refuses a model that needs what
    # its backend lacks, rather than computing full or uncapped attention.
    supports_sliding_window: ClassVar[bool] = False
    supports_logit_softcap: ClassVar[bool] = False

    def __init__(
        self, pool: KVPool, num_heads: int, head_dim: int, scale: float | None = None
    ) -> None:
        if num_heads % pool.num_kv_heads:
            raise ValueError(
                f"{num_heads} query heads do not group over {pool.num_kv_heads} KV heads"
            )
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = pool.num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5

    @abstractmethod
    def init_forward_metadata(self, meta: ForwardMeta) -> None:
        """Prepare per-step state (stored in ``meta.attn``) shared by every layer."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: ForwardMeta
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] (RoPE applied) → [T, H * D]; writes k, v to the pool."""
