"""The example device: a CPU underneath, with its own default attention backend."""

from __future__ import annotations

from typing import ClassVar

from actorlm.config import EngineConfig
from actorlm.gpu.platforms import CpuPlatform

from .record import record

__all__ = ["ExampleDevicePlatform"]


class ExampleDevicePlatform(CpuPlatform):
    name: ClassVar[str] = "example_device"

    def device_name(self, index: int = 0) -> str:
        return "Example Device 1000"

    def default_attention_backend(self) -> str:
        # Registered by this distribution's general plugin (extras.py).
        return "example_device_attention"

    def adjust_defaults(self, config: EngineConfig) -> EngineConfig:
        record("platform.adjust_defaults")
        return super().adjust_defaults(config)
