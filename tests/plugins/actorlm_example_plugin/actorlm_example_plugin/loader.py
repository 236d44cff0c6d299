"""A weight loader: ``load_format="example_safetensors"``."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from actorlm.gpu.loaders.safetensors import SafetensorsLoader

from .record import record

__all__ = ["RecordingSafetensorsLoader"]


class RecordingSafetensorsLoader(SafetensorsLoader):
    """Reads an HF folder like the built-in, and records how many tensors it gave."""

    name = "example_safetensors"

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        count = 0
        for name, tensor in super().weights():
            count += 1
            yield name, tensor
        record("loader.tensors", count)
