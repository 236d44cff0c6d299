"""KV cache eviction strategies for the radix prefix tree (``--eviction-policy``).

Each strategy maps an evictable tree node to a sortable key; the node with the
*smallest* key is evicted first. Only unlocked leaves are ever candidates, so a
strategy decides the order among them and nothing else. Ties on the key are
broken by node creation order (oldest first) by the tree, which keeps eviction
deterministic.

Times are logical: ``last_access_time`` and ``creation_time`` come from a counter
the tree bumps on every operation, never from the wall clock, so the same trace
evicts the same pages on every run.

Plugins add a policy with::

    from actorlm.extensions.points import EVICTION_POLICIES
    EVICTION_POLICIES.register("my-policy", MyStrategy)  # a zero-argument class
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from ...extensions.points import EVICTION_POLICIES

__all__ = [
    "EvictableNode",
    "EvictionStrategy",
    "FIFOStrategy",
    "FILOStrategy",
    "LFUStrategy",
    "LRUStrategy",
    "MRUStrategy",
    "PriorityStrategy",
    "SLRUStrategy",
    "make_strategy",
]


class EvictableNode(Protocol):
    """What a strategy may read from a node (kept minimal so strategies stay tree-agnostic)."""

    @property
    def last_access_time(self) -> int: ...  # logical time of the last match or insert through it
    @property
    def creation_time(self) -> int: ...  # logical time its pages entered the tree
    @property
    def hit_count(self) -> int: ...  # prefix lookups that reused it (inserts do not count)
    @property
    def priority(self) -> int: ...  # highest request priority that inserted through it


class EvictionStrategy(ABC):
    """Orders evictable nodes: ``priority(node)`` smallest is evicted first."""

    name: str = ""

    @abstractmethod
    def priority(self, node: EvictableNode) -> tuple[Any, ...]:
        """Sortable key; the node with the smallest key is evicted first."""


class LRUStrategy(EvictionStrategy):
    """Least recently used first: ascending ``last_access_time``."""

    name = "lru"

    def priority(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.last_access_time,)


class LFUStrategy(EvictionStrategy):
    """Least frequently used first: ascending ``hit_count``, ties by ascending
    ``last_access_time`` (LRU among equally used nodes)."""

    name = "lfu"

    def priority(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.hit_count, node.last_access_time)


class FIFOStrategy(EvictionStrategy):
    """Oldest first: ascending ``creation_time``, whatever the accesses since."""

    name = "fifo"

    def priority(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.creation_time,)


class MRUStrategy(EvictionStrategy):
    """Most recently used first: descending ``last_access_time``. Suits cyclic scans
    larger than the cache, where the newest entry is the one reused last."""

    name = "mru"

    def priority(self, node: EvictableNode) -> tuple[Any, ...]:
        return (-node.last_access_time,)


class FILOStrategy(EvictionStrategy):
    """Newest first: descending ``creation_time``, whatever the accesses since."""

    name = "filo"

    def priority(self, node: EvictableNode) -> tuple[Any, ...]:
        return (-node.creation_time,)


class PriorityStrategy(EvictionStrategy):
    """Lowest request priority first: ascending ``priority``, ties by ascending
    ``last_access_time`` (LRU within a priority level). A node's priority is the
    highest priority of any request that inserted through it, so a prefix shared
    with an important request is kept as long as that request's own pages."""

    name = "priority"

    def priority(self, node: EvictableNode) -> tuple[Any, ...]:
        return (node.priority, node.last_access_time)


class SLRUStrategy(EvictionStrategy):
    """Segmented LRU. A node is *probationary* until it has been hit
    ``protected_threshold`` times (default 2) by prefix lookups, then *protected*.
    All probationary nodes are evicted before any protected one; within a
    segment, ascending ``last_access_time`` (LRU). This keeps one-off prompts from
    flushing prefixes that several requests really share."""

    name = "slru"

    def __init__(self, protected_threshold: int = 2) -> None:
        self.protected_threshold = protected_threshold

    def priority(self, node: EvictableNode) -> tuple[Any, ...]:
        protected = node.hit_count >= self.protected_threshold
        return (protected, node.last_access_time)


_BUILTINS: tuple[type[EvictionStrategy], ...] = (
    LRUStrategy,
    LFUStrategy,
    FIFOStrategy,
    MRUStrategy,
    FILOStrategy,
    PriorityStrategy,
    SLRUStrategy,
)
for _cls in _BUILTINS:
    EVICTION_POLICIES.register_builtin(_cls.name, _cls, help=(_cls.__doc__ or "").split("\n")[0])


def make_strategy(policy: str | EvictionStrategy) -> EvictionStrategy:
    """An instance for a registered name (``"lru"``, ...) or a ready instance as is."""
    if isinstance(policy, EvictionStrategy):
        return policy
    factory = EVICTION_POLICIES.get(policy)
    strategy = factory()
    if not isinstance(strategy, EvictionStrategy):
        raise TypeError(f"eviction policy {policy!r} built {strategy!r}, not an EvictionStrategy")
    return strategy
