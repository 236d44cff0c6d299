"""The lora_loader role: the actor shell (`actor`) over its pure cores: `peft`
(reading and checking PEFT adapters), `registry` (names, ids, the references requests
hold), `slots` (which worker slot holds which adapter) and `eviction` (which slot an
adapter takes when none is free). The weights themselves end up in the worker."""

from __future__ import annotations

from typing import Any

__all__ = ["LoraLoaderActor"]


def __getattr__(name: str) -> Any:
    # Lazily, so the pure cores beside the actor import without the actor runtime.
    if name == "LoraLoaderActor":
        from .actor import LoraLoaderActor

        return LoraLoaderActor
    raise AttributeError(name)
