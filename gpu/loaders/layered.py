"""Layer by layer from safetensors: tensors are read one at a time in layer order
and copied straight into their (freshly materialized) parameter, so peak memory
stays about one layer above the model, whatever the shard sizes."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from safetensors import safe_open

from .safetensors import SafetensorsLoader, shard_files

__all__ = ["LayeredLoader"]

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _order(name: str) -> tuple[int, str]:
    m = _LAYER.search(name)
    # embeddings first, then layers in order, then the final norm and head
    return (int(m.group(1)) if m else (-1 if "embed" in name else 1 << 30), name)


class LayeredLoader(SafetensorsLoader):
    name = "layered"

    def __init__(self, path) -> None:  # type: ignore[no-untyped-def]
        super().__init__(path)
        self._where: dict[str, str] = {}
        for shard in shard_files(self.path):
            with safe_open(str(shard), framework="pt") as f:
                self._where.update(dict.fromkeys(f.keys(), str(shard)))

    def num_weights(self) -> int:
        return len(self._where)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        handles: dict[str, object] = {}
        try:
            for name in sorted(self._where, key=_order):
                shard = self._where[name]
                if shard not in handles:
                    handles[shard] = safe_open(shard, framework="pt")
                yield name, handles[shard].get_tensor(name)  # type: ignore[attr-defined]
        finally:
            handles.clear()
