"""The scheduler role: the actor shell (`actor`) over the pure batching policy
(`policy`: waiting queue, admission, chunked prefill, retraction, finishing)."""

from __future__ import annotations

from typing import Any

__all__ = ["SchedulerActor"]


def __getattr__(name: str) -> Any:
    # Lazily, so the pure cores beside the actor import without the actor runtime.
    if name == "SchedulerActor":
        from .actor import SchedulerActor

        return SchedulerActor
    raise AttributeError(name)
