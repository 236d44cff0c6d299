"""Model classes by HF architecture name (config.json ``architectures``): a native
model built on the meta device, or the transformers fallback."""

from __future__ import annotations

from pathlib import Path

import torch
from actorlm.extensions.points import MODELS
from torch import nn

from ..model_info import ModelInfo
from . import resolve_model_impl

__all__ = ["build_fallback", "build_model", "resolve_model_impl"]


def build_model(info: ModelInfo, max_model_len: int | None = None) -> nn.Module:
    """The registered model for ``info.architecture``, its parameters on the meta device:
    a loader materializes each one as its tensor arrives, so nothing is initialized twice."""
    cls = MODELS.get(info.architecture)
    with torch.device("meta"):
        model = cls(info, max_model_len=max_model_len)
    return model.eval()


def build_fallback(
    path: Path, info: ModelInfo, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """transformers' own model for ``path``, its attention on actorlm's backends."""
    from .hf_fallback import TransformersCausalLM

    if not path.is_dir():
        raise ValueError(f"{path}: the transformers fallback runs HF folders, not GGUF files")
    return TransformersCausalLM(path, info, dtype, device)
