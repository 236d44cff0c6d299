"""Transports: how frames move between actor inboxes.

An address picks the transport: ``inproc://`` (same process), ``ipc://`` (same
host, a Unix socket file), ``tcp://`` (other hosts). Every actor binds one PULL
socket (its inbox); senders keep one PUSH socket per peer address. The
in-memory transport used by the test harness has the same interface and still
moves encoded frames, so codec and interceptors run as they do on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import zmq
import zmq.asyncio

__all__ = [
    "Frames",
    "Inbox",
    "MemoryTransport",
    "Outbox",
    "Transport",
    "ZmqTransport",
    "ipc_path",
]

Frames = Sequence[bytes | memoryview]


class Inbox(Protocol):
    async def recv(self) -> list[bytes]: ...
    def close(self) -> None: ...


class Outbox(Protocol):
    async def send(self, frames: Frames) -> None: ...
    def close(self) -> None: ...


class Transport(Protocol):
    def bind(self, address: str) -> Inbox: ...
    def connect(self, address: str) -> Outbox: ...
    def close(self) -> None: ...


def ipc_path(address: str) -> str | None:
    return address[len("ipc://") :] if address.startswith("ipc://") else None


class _ZmqInbox:
    """A PULL socket read straight off the event loop.

    zmq.asyncio costs a future and a poller round per message. Instead the
    socket's FD is watched once (``add_reader``) and each wake-up drains every
    queued message with non-blocking receives, so a burst costs one wake-up and
    ``recv`` returns without suspending while frames are queued. The ZMQ FD is
    edge-triggered: it only fires again after a receive has returned ``Again``,
    which is why the drain always runs until then.
    """

    def __init__(self, sock: zmq.Socket[bytes], address: str) -> None:
        self._sock = sock
        self._address = address
        self._queue: deque[list[bytes]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = sock.getsockopt(zmq.FD)

    def _drain(self) -> None:
        recv, queue = self._sock.recv_multipart, self._queue
        try:
            while True:
                queue.append(recv(zmq.NOBLOCK))
        except zmq.Again:
            pass
        waiter = self._waiter
        if queue and waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def recv(self) -> list[bytes]:
        queue = self._queue
        if not queue:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._loop.add_reader(self._fd, self._drain)
            self._drain()  # frames that came before the reader was watching
            while not queue:
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        return queue.popleft()

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=0)
        path = ipc_path(self._address)
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class _ZmqOutbox:
    """A PUSH socket with no send limit: a non-blocking send always succeeds
    at once, so no future is made; ``Again`` (never expected) falls back to zmq.asyncio."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock

    async def send(self, frames: Frames) -> None:
        try:
            # copy=False: tensor frames go zero-copy; pyzmq still copies small ones.
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            await zmq.asyncio.Socket.shadow(self._sock.underlying).send_multipart(
                frames, copy=False
            )

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqTransport:
    """ZMQ PUSH/PULL over inproc, ipc or tcp. ``inproc`` peers must share the
    context, so in-process placements pass one ZmqTransport to every actor."""

    def __init__(self, context: zmq.asyncio.Context | None = None) -> None:
        self._own_context = context is None
        self.context = context or zmq.asyncio.Context()
        # Plain sockets on the same libzmq context (inproc peers must share it).
        self._sync = zmq.Context.shadow(self.context.underlying)

    def bind(self, address: str) -> Inbox:
        path = ipc_path(address)
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale file from a crashed run
        sock: zmq.Socket[bytes] = self._sync.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(address)
        return _ZmqInbox(sock, address)

    def connect(self, address: str) -> Outbox:
        sock: zmq.Socket[bytes] = self._sync.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow peer; memory is the bound
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return _ZmqOutbox(sock)

    def close(self) -> None:
        if self._own_context:
            self.context.term()


class _MemoryQueue:
    def __init__(self, transport: MemoryTransport, address: str) -> None:
        self._transport = transport
        self._address = address
        self.queue: asyncio.Queue[list[bytes]] = asyncio.Queue()

    async def recv(self) -> list[bytes]:
        return await self.queue.get()

    async def send(self, frames: Frames) -> None:
        self.queue.put_nowait([bytes(f) for f in frames])

    def close(self) -> None:
        self._transport.inboxes.pop(self._address, None)


class _MemoryOutbox:
    def __init__(self, transport: MemoryTransport, address: str) -> None:
        self._transport = transport
        self._address = address

    async def send(self, frames: Frames) -> None:
        inbox = self._transport.inboxes.get(self._address)
        if inbox is not None:  # like a socket whose peer is gone: the frames are lost
            await inbox.send(frames)

    def close(self) -> None:
        pass


class MemoryTransport:
    """Frames through asyncio queues, for the test harness (deterministic, no sleeps)."""

    def __init__(self) -> None:
        self.inboxes: dict[str, _MemoryQueue] = {}

    def bind(self, address: str) -> Inbox:
        if address in self.inboxes:
            raise OSError(f"address in use: {address}")
        inbox = self.inboxes[address] = _MemoryQueue(self, address)
        return inbox

    def connect(self, address: str) -> Outbox:
        return _MemoryOutbox(self, address)

    def pending(self) -> int:
        return sum(q.queue.qsize() for q in self.inboxes.values())

    def close(self) -> None:
        self.inboxes.clear()
