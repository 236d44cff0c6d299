"""The worker role: the actor shell (`actor`) over `actorlm.gpu.runner` (model, KV
tensors, attention backend, sampler)."""

from __future__ import annotations

from typing import Any

__all__ = ["WorkerActor"]


def __getattr__(name: str) -> Any:
    # Lazily, so the pure cores beside the actor import without the actor runtime.
    if name == "WorkerActor":
        from .actor import WorkerActor

        return WorkerActor
    raise AttributeError(name)
