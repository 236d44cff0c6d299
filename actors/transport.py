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
    def __init__(self, sock: zmq.asyncio.Socket, address: str) -> None:
        self._sock = sock
        self._address = address

    async def recv(self) -> list[bytes]:
        return await self._sock.recv_multipart()

    def close(self) -> None:
        self._sock.close(linger=0)
        path = ipc_path(self._address)
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class _ZmqOutbox:
    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self._sock = sock

    async def send(self, frames: Frames) -> None:
        await self._sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqTransport:
    """ZMQ PUSH/PULL over inproc, ipc or tcp. ``inproc`` peers must share the
    context, so in-process placements pass one ZmqTransport to every actor."""

    def __init__(self, context: zmq.asyncio.Context | None = None) -> None:
        self._own_context = context is None
        self.context = context or zmq.asyncio.Context()

    def bind(self, address: str) -> Inbox:
        path = ipc_path(address)
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale file from a crashed run
        sock = self.context.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(address)
        return _ZmqInbox(sock, address)

    def connect(self, address: str) -> Outbox:
        sock = self.context.socket(zmq.PUSH)
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
