"""HF folders: config.json, one or many *.safetensors (with the sharded index), read a shard at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..model_info import ModelInfo, hf_model_info
from .base import WeightLoader

__all__ = ["SafetensorsLoader", "shard_files"]


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


class SafetensorsLoader(WeightLoader):
    name = "safetensors"

    def model_info(self) -> ModelInfo:
        return hf_model_info(self.path)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for shard in shard_files(self.path):
            tensors = load_file(str(shard))  # the whole shard: fewest reads, peak = model + shard
            yield from tensors.items()
            del tensors
