"""The weight-loader interface and ``load_model``: ModelConfig → a ready model.

A loader reads one file format and yields HF-named tensors; the model routes
each into its (possibly fused) parameter, materializing it on first touch. So
every format shares one model-building path, and peak memory is the model plus
whatever the loader holds at once (a shard, a layer, a tensor).
"""

from __future__ import annotations

import logging
import resource
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from actorlm.config import ModelConfig
from actorlm.extensions.points import WEIGHT_LOADERS
from tqdm import tqdm

from ..model_info import ModelInfo

__all__ = ["WeightLoader", "load_model", "make_loader", "model_path", "resolve_load_format"]

log = logging.getLogger(__name__)


class WeightLoader(ABC):
    name: ClassVar[str] = ""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @abstractmethod
    def model_info(self) -> ModelInfo:
        """Architecture and hyperparameters, from metadata only."""

    @abstractmethod
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor) pairs; any float dtype, on the CPU."""

    def num_weights(self) -> int | None:
        return None

    def load(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        """Fill every parameter of ``model`` (built on the meta device) from this file."""
        t0 = time.perf_counter()
        loaded: set[str] = set()
        desc = f"loading {self.path.name} ({self.name})"
        for name, tensor in tqdm(
            self.weights(), total=self.num_weights(), desc=desc, unit="tensor", leave=False
        ):
            key = model.load_weight(name, tensor, device, dtype)
            if key is not None:
                loaded.add(key)
        model.finish_loading(loaded)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        log.info(
            "loaded %s with %s in %.1f s: %.1f MiB of %s weights on %s, peak RSS %.0f MiB",
            self.path,
            self.name,
            time.perf_counter() - t0,
            nbytes / 2**20,
            str(dtype).removeprefix("torch."),
            device,
            peak_mib,
        )


def model_path(cfg: ModelConfig) -> Path:
    """``cfg.path``, or the embedded default model when empty."""
    if cfg.path:
        return Path(cfg.path).expanduser()
    from ..default_model import default_model_path

    return default_model_path()


def resolve_load_format(load_format: str, path: Path) -> str:
    if load_format != "auto":
        return load_format
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir():
        return "safetensors"
    raise FileNotFoundError(f"{path}: not a .gguf file or a model folder")


def make_loader(cfg: ModelConfig) -> WeightLoader:
    import actorlm.gpu.loaders  # noqa: F401  (registers the built-ins)

    path = model_path(cfg)
    cls = WEIGHT_LOADERS.get(resolve_load_format(cfg.load_format, path))
    return cls(path)


def load_model(
    cfg: ModelConfig, max_model_len: int | None = None, loader: WeightLoader | None = None
) -> tuple[Any, ModelInfo]:
    """Build the registered model for the file at ``cfg.path`` and load its weights."""
    from ..models.registry import build_fallback, build_model, resolve_model_impl
    from ..platforms import resolve_dtype

    loader = loader or make_loader(cfg)
    info = loader.model_info()
    device = torch.device(cfg.device or "cpu")
    dtype = getattr(torch, resolve_dtype(cfg.dtype, cfg.device))  # "auto": the platform's
    if resolve_model_impl(info.architecture, cfg.model_impl, info.native_gaps) == "transformers":
        return build_fallback(loader.path, info, dtype, device), info
    model = build_model(info, max_model_len)
    loader.load(model, device, dtype)
    return model, info
