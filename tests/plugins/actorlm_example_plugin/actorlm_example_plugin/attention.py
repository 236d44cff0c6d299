"""An attention backend: ``attention_backend="example_counting"``."""

from __future__ import annotations

from actorlm.gpu.attention.torch_native import TorchNativeBackend
from actorlm.gpu.forward_meta import ForwardMeta

from .record import record

__all__ = ["CountingTorchBackend"]


class CountingTorchBackend(TorchNativeBackend):
    """The torch backend; records every forward step it prepares."""

    def init_forward_metadata(self, meta: ForwardMeta) -> None:
        record("attention.step")
        super().init_forward_metadata(meta)
