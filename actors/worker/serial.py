"""The worker's jobs on its runner (forward steps, KV pages written in, resets), run one
at a time in the order they arrive, on one thread of their own.

A step handed to ``asyncio.to_thread`` behind an ``asyncio.Lock`` could only start once
the event loop had woken for the previous step's end, released the lock, and resumed
the next handler, which handed it to an executor thread: ~0.20 ms between two steps,
measured in the worker on one core of two. With overlap scheduling the next step is
already here when one ends: this thread goes straight on to it (~0.035 ms), and the
loop sends the finished step's result meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["SerialThread"]

T = TypeVar("T")

_Job = tuple[Callable[[], Any], "asyncio.Future[Any]", asyncio.AbstractEventLoop]


class SerialThread:
    """``await serial.submit(fn)`` runs ``fn()`` on this thread after every job submitted
    before it, and gives its result (or raises its exception) on the caller's loop."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, fut, loop))
        return fut

    def close(self) -> None:
        """The thread ends after the jobs already submitted."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut, loop = job
            try:
                result, error = fn(), None
            except BaseException as exc:  # the caller gets it, whatever it is
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for it
                loop.call_soon_threadsafe(_settle, fut, result, error)


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
