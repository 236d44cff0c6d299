"""A KV eviction policy: ``eviction_policy="example_oldest_first"``."""

from __future__ import annotations

from typing import Any

from actorlm.actors.cache.eviction import EvictableNode, EvictionStrategy

from .record import record

__all__ = ["OldestFirst"]


class OldestFirst(EvictionStrategy):
    """Evict the pages that entered the prefix tree first (smallest key goes first)."""

    name = "example_oldest_first"

    def __init__(self) -> None:
        record("eviction.init")

    def priority(self, node: EvictableNode) -> tuple[Any, ...]:
        record("eviction.priority")
        return (node.creation_time,)
