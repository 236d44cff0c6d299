"""WorkerActor: one ForwardBatch in, one StepResult out, the forward pass off the loop.

The model, its KV tensors, the attention backend and the sampler all live in
:class:`~actorlm.gpu.runner.ModelRunner`; this actor only moves messages.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from ..messages.control import GetInfo, Info
from ..messages.envelope import Envelope
from ..messages.step import ForwardBatch, StepResult
from .runtime import Actor, handles

__all__ = ["WorkerActor"]

log = logging.getLogger(__name__)


class WorkerActor(Actor):
    role = "worker"
    inbox = (ForwardBatch, GetInfo)

    async def on_start(self) -> None:
        from ..gpu.runner import ModelRunner

        self.runner = await self.run_blocking(ModelRunner, self.config.model)
        # One forward at a time: the runner's KV pool and sampler state are not shared-safe.
        self._lock = asyncio.Lock()
        self.steps = 0
        self.forward_ms = 0.0

    def ready_info(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.runner.info)

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps, "forward_ms_total": self.forward_ms}

    @handles(GetInfo)
    async def on_info(self, msg: GetInfo, env: Envelope) -> Info:
        return Info(role=self.role, values=self.ready_info())

    @handles(ForwardBatch)
    async def on_forward(self, msg: ForwardBatch, env: Envelope) -> StepResult:
        async with self._lock:
            result = await self.run_blocking(self.runner.forward, msg)
        self.steps += 1
        self.forward_ms += result.forward_ms
        return result
