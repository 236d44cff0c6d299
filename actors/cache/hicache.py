"""HiCache storage tier: KV page blobs kept beyond GPU and host memory (``--hicache-storage-backend``).

A backend is a flat key → bytes store. Keys come from ``page_keys``: one per full
page, each a hash chained over the model id, the page size and every token up
to and including that page. A page's key therefore names its whole prefix, so
two servers (or one server after a restart) serving the same model compute the
same keys for the same prompt and can reuse each other's pages.

Backends must be safe for several processes sharing one store: a reader sees a
whole blob or none, never a partial write.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import tempfile
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...extensions.points import HICACHE_STORAGE

__all__ = ["HiCacheFile", "HiCacheStorage", "page_keys", "storage_model_id"]

_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_TMP_SUFFIX = ".tmp"
_MAGIC = b"ALKV"
_HEADER = struct.Struct("<4sIQ")  # magic, CRC-32 of the blob, its length


def page_keys(model_id: str, token_ids: Sequence[int], page_size: int) -> list[str]:
    """One storage key per full page of ``token_ids`` (a trailing partial page has none).

    Key ``i`` is a SHA-256 chain over ``model_id``, ``page_size`` and pages
    ``0..i``, so it identifies the entire prefix, not just the page's own tokens.
    Fold anything else that changes the KV bytes (dtype, tensor-parallel rank,
    LoRA adapter) into ``model_id``. hashlib, not ``hash()``: keys must be equal
    across processes and Python versions.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    digest = hashlib.sha256(f"actorlm-kv\0{model_id}\0{page_size}".encode()).digest()
    keys: list[str] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start : start + page_size]
        # Fixed-width little-endian int64 so the bytes do not depend on the platform.
        digest = hashlib.sha256(digest + struct.pack(f"<{page_size}q", *page)).digest()
        keys.append(digest.hex())
    return keys


def storage_model_id(config: Any) -> str:
    """What KV bytes depend on besides the tokens: the model file, dtype and page size."""
    m = config.model
    size = os.path.getsize(m.path) if os.path.isfile(m.path) else 0
    return f"{os.path.abspath(m.path)}|{size}|{m.dtype}|{m.page_size}"


class HiCacheStorage(ABC):
    """A key → bytes store for KV page blobs.

    ``batch_exists`` returns how many *leading* keys exist, because a cached
    prefix is only usable up to its first missing page.
    """

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The blob stored under ``key``, or None."""

    @abstractmethod
    def set(self, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key`` (replacing any); True on success."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every key."""

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> bool:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        return all([self.set(k, v) for k, v in zip(keys, values, strict=True)])

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` present (stops at the first missing one)."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)


class HiCacheFile(HiCacheStorage):
    """One file per key under ``root`` (two-level fan-out by key prefix).

    Writes go to a temporary file in the same directory and are renamed into
    place, which is atomic on POSIX: concurrent readers and writers in other
    processes never see a torn blob, and a crash leaves at most a stray temp file.
    Each file starts with a header holding the blob's length and CRC-32, so an entry
    truncated or damaged anyway (power loss without fsync, a full disk, another
    writer) is found on reading: it is deleted and counted (``corrupt``), and the
    read is a miss, never KV.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync  # durability across power loss costs a disk flush per page
        self.corrupt = 0  # damaged entries found (and dropped) by get

    def _path(self, key: str) -> Path:
        # Keys become file names: refuse anything that could escape root.
        if not _KEY_RE.match(key) or key.endswith(_TMP_SUFFIX) or key.startswith("."):
            raise ValueError(f"invalid HiCache key {key!r}")
        return self.root / key[:2] / key

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) >= _HEADER.size:
            magic, crc, size = _HEADER.unpack_from(data)
            body = data[_HEADER.size :]
            if magic == _MAGIC and size == len(body) and crc == zlib.crc32(body):
                return body
        self.corrupt += 1
        path.unlink(missing_ok=True)
        return None

    def set(self, key: str, value: bytes) -> bool:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, zlib.crc32(value), len(value)))
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return True

    def exists(self, key: str) -> bool:
        """Present and whole as far as its size tells (a truncated entry is dropped here;
        damage inside it is found when it is read)."""
        path = self._path(key)
        try:
            with path.open("rb") as f:
                header = f.read(_HEADER.size)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return False
        if len(header) == _HEADER.size:
            magic, _crc, length = _HEADER.unpack(header)
            if magic == _MAGIC and size == _HEADER.size + length:
                return True
        self.corrupt += 1
        path.unlink(missing_ok=True)
        return False

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def clear(self) -> None:
        for sub in self.root.iterdir():
            if sub.is_dir() and len(sub.name) == 2:  # only our fan-out folders
                for f in sub.iterdir():
                    f.unlink(missing_ok=True)
                sub.rmdir()


HICACHE_STORAGE.register_builtin("file", HiCacheFile, help="page blobs as files under a directory")
