"""LoRA eviction policies (``--lora-eviction-policy``): which worker slot an adapter
that needs one takes when none is free.

A policy maps each evictable slot to a sortable key; the smallest is evicted first.
Only slots whose adapter no running request uses, that is not pinned and not
loading, are candidates, so a policy only orders them. Ties go to the lower slot
number. Times are logical (a counter the slot table bumps), so a trace evicts the
same slots on every run.

Plugins add one with::

    from actorlm.extensions.points import LORA_EVICTION_POLICIES
    LORA_EVICTION_POLICIES.register("my-policy", MyPolicy)  # a zero-argument class
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from ...extensions.points import LORA_EVICTION_POLICIES

__all__ = [
    "EvictionPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "SlotStats",
    "make_policy",
]


class SlotStats(Protocol):
    """What a policy may read about a slot's adapter."""

    @property
    def lora_id(self) -> str: ...
    @property
    def loaded_at(self) -> int: ...  # logical time the adapter went into this slot
    @property
    def last_used(self) -> int: ...  # logical time a request last asked for it
    @property
    def uses(self) -> int: ...  # requests that asked for it since it went into the slot


class EvictionPolicy(ABC):
    """Orders evictable slots: ``priority(slot)`` smallest is evicted first."""

    name: str = ""

    @abstractmethod
    def priority(self, slot: SlotStats) -> tuple[Any, ...]:
        """Sortable key; the slot with the smallest key is evicted first."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def priority(self, slot: SlotStats) -> tuple[Any, ...]:
        return (slot.last_used,)


class LFUPolicy(EvictionPolicy):
    """Least used first; among equally used ones, least recently used."""

    name = "lfu"

    def priority(self, slot: SlotStats) -> tuple[Any, ...]:
        return (slot.uses, slot.last_used)


class FIFOPolicy(EvictionPolicy):
    """The adapter that went into its slot first leaves first."""

    name = "fifo"

    def priority(self, slot: SlotStats) -> tuple[Any, ...]:
        return (slot.loaded_at,)


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from a registered name (or pass one through)."""
    if isinstance(policy, EvictionPolicy):
        return policy
    made = LORA_EVICTION_POLICIES.get(policy)()
    if not isinstance(made, EvictionPolicy):
        raise TypeError(f"LoRA eviction policy {policy!r} built {made!r}, not an EvictionPolicy")
    return made


LORA_EVICTION_POLICIES.register_builtin("lru", LRUPolicy, help="least recently used first")
LORA_EVICTION_POLICIES.register_builtin("lfu", LFUPolicy, help="least used first")
LORA_EVICTION_POLICIES.register_builtin("fifo", FIFOPolicy, help="first loaded, first evicted")
