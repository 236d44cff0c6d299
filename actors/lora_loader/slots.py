"""The worker's adapter slots as the loader keeps them: which adapter each slot holds
(or is loading), and which slot an adapter that needs one takes.

``assign`` walks the adapters waiting requests want, in queue order, and gives each
one a free slot or, failing that, the slot the eviction policy picks among those
that are neither pinned, loading, used by a running request, nor wanted by a request
ahead in the queue. When no slot can be taken it stops: later adapters wait, and
running requests (whose slots are safe) finish and free theirs, so waiting never
turns into a deadlock. Pure Python: no asyncio, zmq or torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from .eviction import EvictionPolicy

__all__ = ["Slot", "SlotLoad", "SlotTable"]


@dataclass
class Slot:
    lora_id: str
    loaded_at: int
    last_used: int
    uses: int = 1
    ready: bool = False  # in the worker; False while its weights travel
    pinned: bool = False


class SlotLoad(NamedTuple):
    slot: int
    lora_id: str
    evicted: str | None  # the adapter it held before, if any


class SlotTable:
    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        if num_slots < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1, got {num_slots}")
        self.slots: list[Slot | None] = [None] * num_slots
        self.policy = policy
        self._clock = itertools.count(1)
        self.stats = {"slot_hits": 0, "slot_misses": 0, "slot_loads": 0, "slot_evictions": 0}

    def slot_of(self, lora_id: str) -> int | None:
        for i, s in enumerate(self.slots):
            if s is not None and s.lora_id == lora_id:
                return i
        return None

    def is_ready(self, lora_id: str) -> bool:
        i = self.slot_of(lora_id)
        return i is not None and bool(self.slots[i] and self.slots[i].ready)  # type: ignore[union-attr]

    def ready_ids(self) -> list[str]:
        return [s.lora_id for s in self.slots if s is not None and s.ready]

    @property
    def num_pinned(self) -> int:
        return sum(1 for s in self.slots if s is not None and s.pinned)

    def touch(self, lora_id: str) -> None:
        """A request asked for ``lora_id`` (a slot hit if it is in one)."""
        i = self.slot_of(lora_id)
        slot = self.slots[i] if i is not None else None
        if slot is None:
            self.stats["slot_misses"] += 1
            return
        self.stats["slot_hits"] += 1
        slot.last_used = next(self._clock)
        slot.uses += 1

    def assign(
        self, wanted: Iterable[str], in_use: Iterable[str], *, pin: bool = False
    ) -> list[SlotLoad]:
        """Slots for the ``wanted`` adapters that have none, in order (see the module)."""
        protected = set(in_use)
        loads: list[SlotLoad] = []
        for lora_id in dict.fromkeys(wanted):
            i = self.slot_of(lora_id)
            if i is not None:
                slot = self.slots[i]
                assert slot is not None
                slot.pinned = slot.pinned or pin
                protected.add(lora_id)
                continue
            target = self._free_or_victim(protected)
            if target is None:
                break
            old = self.slots[target]
            if old is not None:
                self.stats["slot_evictions"] += 1
            now = next(self._clock)
            self.slots[target] = Slot(lora_id, now, now, pinned=pin)
            self.stats["slot_loads"] += 1
            protected.add(lora_id)
            loads.append(SlotLoad(target, lora_id, old.lora_id if old is not None else None))
        return loads

    def _free_or_victim(self, protected: set[str]) -> int | None:
        for i, s in enumerate(self.slots):
            if s is None:
                return i
        candidates = [
            (self.policy.priority(s), i)
            for i, s in enumerate(self.slots)
            if s is not None and s.ready and not s.pinned and s.lora_id not in protected
        ]
        return min(candidates)[1] if candidates else None

    def loaded(self, slot: int, lora_id: str) -> bool:
        """The worker has ``lora_id`` in ``slot`` (False: the slot was given away since)."""
        s = self.slots[slot]
        if s is None or s.lora_id != lora_id:
            return False
        s.ready = True
        return True

    def lost(self, slot: int, lora_id: str) -> None:
        """Loading ``lora_id`` into ``slot`` failed: the slot is free again."""
        s = self.slots[slot]
        if s is not None and s.lora_id == lora_id:
            self.slots[slot] = None

    def unpin(self, lora_id: str) -> None:
        i = self.slot_of(lora_id)
        slot = self.slots[i] if i is not None else None
        if slot is not None:
            slot.pinned = False

    def drop(self, lora_id: str) -> None:
        """``lora_id`` was unloaded: its slot is free."""
        i = self.slot_of(lora_id)
        if i is not None:
            self.slots[i] = None

    def clear(self) -> list[str]:
        """The worker lost every slot (it died or restarted); the adapters it held."""
        held = [s.lora_id for s in self.slots if s is not None]
        self.slots = [None] * len(self.slots)
        return held
