"""A fast GGUF header reader: metadata and tensor locations, weights left on disk.

``gguf.GGUFReader`` builds numpy views for every array item (the 49k vocabulary
strings and 49k merges of the default model), which takes seconds; this reader
skips big arrays (keeping their length) so sizing a KV pool costs milliseconds,
and serves each tensor as a memory-mapped byte view for ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFArray", "GGUFFile", "GGUFTensor"]

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
KEEP_ARRAY_ITEMS = 256  # longer arrays keep only their length (read them with gguf.GGUFReader)


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array too long to decode eagerly."""

    item_type: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major (numpy order): GGUF lists dims innermost first
    qtype: int  # gguf.GGMLQuantizationType value
    offset: int  # from the start of the file


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        magic, self.version = self._buf[:4], self._unpack("<4xI")
        if magic != b"GGUF" or self.version < 2:
            raise ValueError(f"{self.path}: not a GGUF v2+ file")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            qtype, offset = self._unpack("<I"), self._unpack("<Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors = {n: GGUFTensor(n, s, q, data_start + o) for n, s, q, o in infos}

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        s = self._buf[self._pos : self._pos + n].decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, length = self._unpack("<I"), self._unpack("<Q")
            if length <= KEEP_ARRAY_ITEMS:
                return [self._value(item_type) for _ in range(length)]
            if item_type == _STRING:
                for _ in range(length):  # lengths only: no decoding
                    self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]
            elif item_type in _SCALARS:
                self._pos += length * struct.calcsize(_SCALARS[item_type])
            else:
                for _ in range(length):
                    self._value(item_type)
            return GGUFArray(item_type, length)
        return self._unpack(_SCALARS[vtype])

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [rows..., row_bytes], a view of the mapped file."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        t = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.qtype)]
        row_bytes = t.shape[-1] // block * type_size
        rows = int(np.prod(t.shape[:-1], dtype=np.int64))
        arr = np.frombuffer(self._buf, dtype=np.uint8, count=rows * row_bytes, offset=t.offset)
        return arr.reshape(*t.shape[:-1], row_bytes)

    def dequantize(self, name: str) -> np.ndarray:
        """float32 in the tensor's row-major shape."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        qtype = GGMLQuantizationType(t.qtype)
        if qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
            # the default model's formats: in C, a worker start's ~1 s of NumPy saved
            from .kernels.qgemm import dequantize_blocks

            fast = dequantize_blocks(self.raw(name), qtype.name.lower())
            if fast is not None:
                return fast.reshape(t.shape)
        out = dequantize(self.raw(name), qtype)
        return np.asarray(out, dtype=np.float32).reshape(t.shape)
