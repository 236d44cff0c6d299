"""Model classes by HF architecture name (config.json ``architectures``)."""

from __future__ import annotations

import torch
from actorlm.extensions.points import MODELS
from torch import nn

from ..model_info import ModelInfo

__all__ = ["build_model"]


def build_model(info: ModelInfo, max_model_len: int | None = None) -> nn.Module:
    """The registered model for ``info.architecture``, its parameters on the meta device:
    a loader materializes each one as its tensor arrives, so nothing is initialized twice."""
    cls = MODELS.get(info.architecture)
    with torch.device("meta"):
        model = cls(info, max_model_len=max_model_len)
    return model.eval()
