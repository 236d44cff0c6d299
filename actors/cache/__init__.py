"""The cache-manager role: the actor shell (`actor`) over the pure KV cache core:
one step's decisions (`step`), page allocator (`allocator`), radix prefix tree
(`radix`), reference counts and admission (`kv_cache`), eviction strategies
(`eviction`), HiCache storage tiers (`hicache`). Page ids only: the KV tensors
live in the worker."""

from __future__ import annotations

from typing import Any

__all__ = ["CacheManagerActor"]


def __getattr__(name: str) -> Any:
    # Lazily, so the pure cores beside the actor import without the actor runtime.
    if name == "CacheManagerActor":
        from .actor import CacheManagerActor

        return CacheManagerActor
    raise AttributeError(name)
