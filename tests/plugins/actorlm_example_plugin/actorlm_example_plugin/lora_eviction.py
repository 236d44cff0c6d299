"""A LoRA eviction policy: ``lora_eviction_policy="example_most_used_first"``."""

from __future__ import annotations

from typing import Any

from actorlm.actors.lora_loader.eviction import EvictionPolicy, SlotStats

from .record import record

__all__ = ["MostUsedFirst"]


class MostUsedFirst(EvictionPolicy):
    """Evict the adapter requests asked for most (it had its turn); smallest key first."""

    name = "example_most_used_first"

    def __init__(self) -> None:
        record("lora_eviction.init")

    def priority(self, slot: SlotStats) -> tuple[Any, ...]:
        record("lora_eviction.priority")
        return (-slot.uses, slot.loaded_at)
