"""A HiCache storage backend: ``hicache_storage_backend="example_recording"``."""

from __future__ import annotations

from actorlm.actors.cache.hicache import HiCacheFile

from .record import record

__all__ = ["RecordingFileStorage"]


class RecordingFileStorage(HiCacheFile):
    """The built-in file backend (built with the storage dir), recording page moves."""

    def get(self, key: str) -> bytes | None:
        record("storage.get")
        return super().get(key)

    def set(self, key: str, value: bytes) -> bool:
        record("storage.set")
        return super().set(key, value)
