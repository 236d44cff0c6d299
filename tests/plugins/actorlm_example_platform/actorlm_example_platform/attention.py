"""The example device's attention "kernels": the torch backend, recording its steps."""

from __future__ import annotations

from actorlm.gpu.attention.torch_native import TorchNativeBackend
from actorlm.gpu.forward_meta import ForwardMeta

from .record import record

__all__ = ["DeviceAttention"]


class DeviceAttention(TorchNativeBackend):
    def init_forward_metadata(self, meta: ForwardMeta) -> None:
        record("device_attention.step")
        super().init_forward_metadata(meta)
