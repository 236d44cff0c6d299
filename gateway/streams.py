"""Running the engine requests behind one HTTP request and merging their deltas.

An OpenAI request with ``n`` choices (or several prompts) becomes several
``GenerateRequest``s; each runs in its own task so a slow choice never holds up
another. Leaving the ``async with`` for any reason, a client disconnect
included (aiohttp cancels the handler), cancels those tasks, which closes each
``EngineClient.generate`` iterator, which aborts its request in the pipeline and
frees its KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any

from aiohttp import web

from ..actors.client import EngineClient, RequestFailed
from ..actors.runtime import ActorError
from ..messages.errors import HTTP_STATUS, ErrorCode, code_for_status
from ..messages.generate import FinishReason, GenerateRequest, TextDelta
from .errors import ApiError
from .metrics import GatewayMetrics

__all__ = ["Fanout", "SseWriter", "code_error", "delta_error", "failure_error"]


# Seconds a client is told to wait before retrying a request the engine could not take.
RETRY_AFTER_S = 2


def code_error(code: ErrorCode, message: str) -> ApiError:
    """The ApiError for a pipeline error ``code``: its HTTP status, and Retry-After
    where trying again later can succeed."""
    status = HTTP_STATUS[code]
    retry = code in (ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry else None
    return ApiError(status, message, code=code.value, headers=headers)


def delta_error(delta: TextDelta) -> ApiError:
    """The ApiError an error delta stands for."""
    return code_error(delta.error_code or ErrorCode.INTERNAL, delta.error or "the request failed")


def _code(err: ApiError) -> ErrorCode:
    """The typed code an ApiError came from, where it came from one."""
    try:
        return ErrorCode(err.code)
    except ValueError:
        return code_for_status(err.status)


def failure_error(exc: BaseException) -> ApiError:
    if isinstance(exc, RequestFailed):
        return code_error(exc.code, str(exc))
    if isinstance(exc, ActorError):
        return ApiError(exc.status, str(exc), code=exc.code)
    return ApiError(500, f"internal error: {type(exc).__name__}")


class Fanout:
    """``async with Fanout(client, reqs, metrics) as fan: async for index, delta in fan: ...``

    Every request yields its deltas in order, ending with the one that has a
    ``finish_reason``; a request whose stream raised ends with an error delta.
    """

    def __init__(
        self,
        client: EngineClient,
        reqs: Sequence[GenerateRequest],
        metrics: GatewayMetrics,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.reqs = list(reqs)
        self.metrics = metrics
        self._on_exit = on_exit
        self.queue: asyncio.Queue[tuple[int, TextDelta]] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Fanout:
        self.tasks = [asyncio.create_task(self._pump(i, req)) for i, req in enumerate(self.reqs)]
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for task in self.tasks:
            task.cancel()
        # Shielded: the aborts must reach the pipeline even when our own task is being cancelled.
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.gather(*self.tasks, return_exceptions=True))
        finally:
            if self._on_exit is not None:
                self._on_exit()

    async def _pump(self, index: int, req: GenerateRequest) -> None:
        trace = self.metrics.trace()
        try:
            async with contextlib.aclosing(self.client.generate(req)) as stream:
                async for delta in stream:
                    trace.on_delta(delta)
                    self.queue.put_nowait((index, delta))
        except asyncio.CancelledError:
            trace.finish(FinishReason.ABORT)
            raise
        except Exception as exc:
            err = failure_error(exc)
            trace.finish(FinishReason.ERROR)
            self.queue.put_nowait(
                (
                    index,
                    TextDelta(
                        rid=req.rid,
                        finish_reason=FinishReason.ERROR,
                        error=err.message,
                        error_code=_code(err),
                    ),
                )
            )

    def __aiter__(self) -> AsyncIterator[tuple[int, TextDelta]]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[tuple[int, TextDelta]]:
        remaining = len(self.reqs)
        while remaining:
            index, delta = await self.queue.get()
            if delta.finish_reason is not None:
                remaining -= 1
            yield index, delta


class SseWriter:
    """Server-sent events: ``data: <json>\\n\\n`` per event, ``data: [DONE]\\n\\n`` at the end."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> SseWriter:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must not hold events back
            }
        )
        await response.prepare(request)
        return cls(response)

    async def send(self, event: Any) -> None:
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode())

    async def done(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
