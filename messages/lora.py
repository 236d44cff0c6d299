"""The LoRA conversations: gateway ⇄ lora_loader (the adapter registry), scheduler ⇄
lora_loader (references and slot readiness, at most one exchange per step that needs
it), lora_loader → worker (adapter weights into a slot, as raw tensor frames).

An adapter has a ``name`` (what requests ask for) and a ``lora_id``: a digest of its
name and its files' bytes, so the same adapter loaded again has the same id (its
cached KV stays valid) and a changed one never does. Everything past the gateway
keys on the id: the prefix tree, the worker's slots, the scheduler's readiness.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import numpy as np

from .base import Message
from .errors import ErrorCode

__all__ = [
    "ListLoraAdapters",
    "LoadLoraAdapter",
    "LoadLoraSlot",
    "LoraAcquire",
    "LoraAcquired",
    "LoraAdapterInfo",
    "LoraAdapterList",
    "LoraRefused",
    "LoraSlotsChanged",
    "LoraStep",
    "LoraStepResult",
    "LoraTargetWeights",
    "UnloadLoraAdapter",
]


# -- gateway (or Engine) ⇄ lora_loader -------------------------------------------


class LoraAdapterInfo(Message, frozen=True, kw_only=True):
    """One adapter as the registry knows it (the answer to a load or an unload)."""

    TAG: ClassVar[str] = "lora.adapter"
    name: str
    lora_id: str
    path: str
    rank: int  # the largest rank of any module it targets
    target_modules: list[str]
    pinned: bool = False
    slot: int = -1  # the worker slot holding it now, -1: none
    refs: int = 0  # requests using it now
    unloading: bool = False  # unloaded by name, waiting for its last request


class LoadLoraAdapter(Message, frozen=True, kw_only=True):
    """Register ``lora_path`` (a PEFT folder) as ``lora_name``; the reply is its
    ``LoraAdapterInfo``, or an error (400 invalid, 409 name taken) saying why."""

    TAG: ClassVar[str] = "lora.load"
    lora_name: str
    lora_path: str
    pinned: bool = False  # kept in a worker slot for good, never evicted


class UnloadLoraAdapter(Message, frozen=True, kw_only=True):
    """Forget ``lora_name``: new requests for it get a 404 at once; the reply (its last
    ``LoraAdapterInfo``) comes when the last request using it has finished."""

    TAG: ClassVar[str] = "lora.unload"
    lora_name: str


class ListLoraAdapters(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "lora.list"


class LoraAdapterList(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "lora.adapters"
    adapters: list[LoraAdapterInfo]
    max_loras_per_batch: int = 0
    max_lora_rank: int = 0


# -- scheduler ⇄ lora_loader ------------------------------------------------------


class LoraAcquire(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    name: str  # the adapter the request asked for (``lora_path``)


class LoraAcquired(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    lora_id: str


class LoraRefused(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    message: str
    code: ErrorCode = ErrorCode.NOT_FOUND


class LoraStep(Message, frozen=True, kw_only=True):
    """Sent when the scheduler's adapter needs changed. ``acquire``: take a reference
    for each request (held until ``release`` names its rid); ``wanted``: adapters
    waiting requests need in a slot, in queue order; ``in_use``: adapters of running
    requests, whose slots must not be taken."""

    TAG: ClassVar[str] = "lora.step"
    acquire: list[LoraAcquire] = []
    release: list[str] = []
    wanted: list[str] = []
    in_use: list[str] = []


class LoraStepResult(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "lora.step_result"
    acquired: list[LoraAcquired] = []
    refused: list[LoraRefused] = []
    # Adapters in a worker slot now, loaded into this incarnation of the worker: a
    # scheduler that knows another one (it restarted) waits for fresh news.
    ready: list[str] = []
    worker_incarnation: int = 0


class LoraSlotsChanged(Message, frozen=True, kw_only=True):
    """lora_loader → scheduler: a slot finished loading or was lost; ask again."""

    TAG: ClassVar[str] = "lora.slots_changed"


# -- lora_loader → worker -----------------------------------------------------------


class LoraTargetWeights(msgspec.Struct, frozen=True, kw_only=True):
    """One projection's weights for every layer, float32, the scaling folded into ``b``:
    ``a`` [L, r, in], ``b`` [L, out, r] (zero in layers the adapter leaves alone)."""

    module: str  # q_proj | k_proj | v_proj | o_proj | gate_proj | up_proj | down_proj
    a: np.ndarray
    b: np.ndarray


class LoadLoraSlot(Message, frozen=True, kw_only=True):
    """Put ``lora_id``'s weights in worker slot ``slot``, over what it held. An adapter
    may come in several parts (large ones would pass the message size limit); the slot
    serves requests once the ``last`` part is in. ``targets`` missing from every part
    are not adapted."""

    TAG: ClassVar[str] = "lora.load_slot"
    slot: int
    lora_id: str
    targets: list[LoraTargetWeights]
    first: bool = True
    last: bool = True
