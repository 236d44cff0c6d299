"""Transports: how frames move between actor inboxes.

An address picks the transport: ``inproc://`` (same process), ``unix://`` (same
host, a Unix socket file, frames written straight from the event loop: module
``unix``), ``ipc://`` (the same through ZMQ, for ZMQ peers), ``tcp://`` (other
hosts). Every actor binds one inbox (a PULL socket on ZMQ); senders keep one outbox
(a PUSH socket) per peer address. The in-memory transport used by the test harness
has the same interface and still moves encoded frames, so codec and interceptors
run as they do on the wire.

An inbox hands each message's frames to the function given to ``listen``,
straight from the event loop's callback and in arrival order, so a message
costs no future and no task switch before the actor sees it, with the identity
its connection proved ("" where nothing is proved: ipc, inproc, memory, tcp
without keys).

tcp sockets use CurveZMQ when the transport has keys (``keys``): an inbox is a
CURVE server admitting only those keys, an outbox authenticates as its own role
to the peer role's key. Without keys, binding tcp beyond loopback is refused
unless ``insecure``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import zmq
import zmq.asyncio

from ...config import DeployConfig
from .keys import CurveKeys, InsecureBindError, RoleAuthenticator, is_loopback
from .unix import UnixInbox, UnixOutbox, clear_socket_path, unix_path

__all__ = [
    "free_port",
    "Deliver",
    "Frames",
    "Inbox",
    "MemoryTransport",
    "Outbox",
    "Transport",
    "ZmqTransport",
    "ipc_path",
]

Frames = Sequence[bytes | memoryview]
Deliver = Callable[[list[bytes], str], None]  # frames, and the identity they came with

log = logging.getLogger(__name__)

# Plain ints: pyzmq's flag enums combine and convert in Python on every call.
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_COPY_THRESHOLD = zmq.COPY_THRESHOLD
_IntOption = Callable[[int], int]  # getsockopt of an int option


class Inbox(Protocol):
    def listen(self, deliver: Deliver) -> None:
        """From now on call ``deliver(frames, identity)`` for each message (queued ones
        first), from the running loop; never twice or out of order."""
        ...

    def close(self) -> None: ...


class Outbox(Protocol):
    async def send(self, frames: Frames) -> None: ...
    def close(self) -> None: ...


class Transport(Protocol):
    def bind(self, address: str, role: str = "") -> Inbox:
        """``role``'s inbox at ``address``."""
        ...

    def connect(self, address: str, peer: str = "", role: str = "") -> Outbox:
        """An outbox from ``role`` to ``peer`` at ``address``."""
        ...

    def close(self) -> None: ...


def ipc_path(address: str) -> str | None:
    return address[len("ipc://") :] if address.startswith("ipc://") else None


class _ZmqInbox:
    """A PULL socket read straight off the event loop.

    zmq.asyncio costs a future and a poller round per message. Instead the
    socket's FD is watched (``add_reader``) and read with non-blocking receives.
    The ZMQ FD is edge-triggered: it fires again only once the socket has been
    read empty, so every wake-up ends with a drain that reads until
    ``ZMQ_EVENTS`` says nothing is left (asking costs half a failed receive,
    whose ``Again`` exception is built in Python).

    Asking is a syscall, and a request/reply waits on it, so a wake-up delivers
    the message that woke it first and the drain runs in a loop callback after
    whatever that delivery started (a handler, a caller waiting for this reply).
    A burst costs one wake-up and one drain. Frames are read one by one, a
    frame's ``more`` saying whether another part follows: ``recv_multipart``
    asks the socket that with a ``getsockopt`` per frame, which pyzmq turns into
    an enum in Python.
    """

    def __init__(self, sock: zmq.Socket[bytes], address: str, curve: bool = False) -> None:
        self._sock = sock
        self._address = address
        self._curve = curve  # read who each message's connection proved to be
        self._deliver: Deliver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_pending = False
        self._fd = cast(int, sock.getsockopt(zmq.FD))

    def listen(self, deliver: Deliver) -> None:
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._on_readable)
        self._drain()  # frames that came before the reader was watching

    def _on_readable(self) -> None:
        if self._deliver is None:
            return
        try:
            parts, identity = self._read()
        except zmq.Again:  # woken with nothing to read: the socket is empty again
            return
        self._hand_over(parts, identity)
        if not self._drain_pending:  # after the callbacks the delivery scheduled
            assert self._loop is not None
            self._drain_pending = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_pending = False
        if self._deliver is None:
            return
        events = cast(_IntOption, self._sock.getsockopt)
        batch: list[tuple[list[bytes], str]] = []
        try:
            while events(_EVENTS) & _POLLIN:
                batch.append(self._read())
        except zmq.Again:  # pragma: no cover - EVENTS said a message was there
            pass
        for parts, identity in batch:  # all read first: a failing delivery leaves nothing unread
            self._hand_over(parts, identity)

    def _read(self) -> tuple[list[bytes], str]:
        recv = self._sock.recv
        frame = recv(_NOBLOCK, copy=False)
        identity = str(frame.get("User-Id") or "") if self._curve else ""
        parts = [frame.bytes]
        while frame.more:
            frame = recv(_NOBLOCK, copy=False)
            parts.append(frame.bytes)
        return parts, identity

    def _hand_over(self, parts: list[bytes], identity: str) -> None:
        if self._deliver is None:  # closed by an earlier delivery
            return
        try:
            self._deliver(parts, identity)
        except Exception:
            log.exception("%s: delivering a message failed", self._address)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._deliver = None
        self._sock.close(linger=0)
        path = ipc_path(self._address)
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class _ZmqOutbox:
    """A PUSH socket with no send limit: a non-blocking send always succeeds
    at once, so no future is made; ``Again`` (never expected) falls back to zmq.asyncio.

    Frames go out one ``send`` each with plain-int flags: ``send_multipart``
    re-checks every frame and combines pyzmq's enum flags in Python, which costs
    more than the send itself for the two small frames of most messages. Frames
    from ``zmq.COPY_THRESHOLD`` bytes up (tensor buffers, big bodies) go zero-copy;
    smaller ones are copied, as pyzmq would, but without its slower zero-copy path.
    """

    def __init__(self, sock: zmq.Socket[bytes], inproc: bool = False) -> None:
        self._sock = sock
        # An inproc PUSH queues for a peer not bound yet, but once the peer's socket has
        # closed it has no pipe, ever (a peer bound again is reached by a new outbox):
        # Again then means the peer is gone, and waiting would wait forever.
        self._inproc = inproc

    async def send(self, frames: Frames) -> None:
        send, last = self._sock.send, len(frames) - 1
        try:
            # libzmq takes a message's later parts once it took the first, so
            # Again can only come before anything was queued.
            for i, frame in enumerate(frames):
                copy = len(frame) < _COPY_THRESHOLD
                send(frame, _NOBLOCK if i == last else _MORE_NOBLOCK, copy=copy)
        except zmq.Again:
            if self._inproc:
                raise ConnectionError("the inproc peer's socket is closed") from None
            await zmq.asyncio.Socket.shadow(self._sock.underlying).send_multipart(
                frames, copy=False
            )

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqTransport:
    """ZMQ PUSH/PULL over inproc, ipc or tcp, and ``unix://`` addresses without ZMQ.
    ``inproc`` peers must share the context, so in-process placements pass one
    ZmqTransport to every actor."""

    def __init__(
        self,
        context: zmq.asyncio.Context | None = None,
        *,
        keys: CurveKeys | None = None,
        insecure: bool = False,
    ) -> None:
        self._own_context = context is None
        self.context = context or zmq.asyncio.Context()
        # Plain sockets on the same libzmq context (inproc peers must share it).
        self._sync: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self.context.underlying)
        self.keys = keys
        self.insecure = insecure
        self._auth: RoleAuthenticator | None = None

    @classmethod
    def for_deploy(cls, deploy: DeployConfig) -> ZmqTransport:
        """A transport with the deployment's keys (and its ``insecure`` choice)."""
        keys = CurveKeys.load(deploy.keys_dir) if deploy.keys_dir else None
        return cls(keys=keys, insecure=deploy.insecure)

    def bind(self, address: str, role: str = "") -> Inbox:
        if unix := unix_path(address):
            return UnixInbox(unix)
        path = ipc_path(address)
        if path:
            clear_socket_path(path)
        sock: zmq.Socket[bytes] = self._sync.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        curve = address.startswith("tcp://") and self.keys is not None
        if curve:
            assert self.keys is not None
            if self._auth is None:
                self._auth = RoleAuthenticator(self._sync, self.keys)
            sock.curve_publickey, sock.curve_secretkey = self.keys.pair(role)
            sock.curve_server = True
        elif address.startswith("tcp://") and not self.insecure:
            host = address[len("tcp://") :].rpartition(":")[0]
            if not is_loopback(host):
                sock.close(linger=0)
                raise InsecureBindError(
                    f"refusing to bind {address} without CurveZMQ keys: anyone who can reach "
                    "it could command the actors. Create keys with `actorlm keys DIR` and set "
                    "deploy.keys_dir (--keys-dir), or pass --insecure"
                )
        sock.bind(address)
        return _ZmqInbox(sock, address, curve)

    def connect(self, address: str, peer: str = "", role: str = "") -> Outbox:
        if unix := unix_path(address):
            return UnixOutbox(unix)
        sock: zmq.Socket[bytes] = self._sync.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow peer; memory is the bound
        sock.setsockopt(zmq.LINGER, 0)
        if address.startswith("tcp://") and self.keys is not None:
            sock.curve_publickey, sock.curve_secretkey = self.keys.pair(role)
            sock.curve_serverkey = self.keys.public(peer)
        sock.connect(address)
        return _ZmqOutbox(sock, inproc=address.startswith("inproc://"))

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context:
            self.context.term()


class _MemoryQueue:
    """An inbox in memory: ``send`` queues, a loop callback delivers (never inline,
    so a sender does not run its receiver's code in the middle of its own)."""

    def __init__(self, transport: MemoryTransport, address: str) -> None:
        self._transport = transport
        self._address = address
        self.queue: deque[list[bytes]] = deque()
        self._deliver: Deliver | None = None

    def listen(self, deliver: Deliver) -> None:
        self._deliver = deliver
        if self.queue:
            asyncio.get_running_loop().call_soon(self._flush)

    async def send(self, frames: Frames) -> None:
        self.queue.append([bytes(f) for f in frames])
        if len(self.queue) == 1 and self._deliver is not None:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        while self.queue and self._deliver is not None:
            frames = self.queue.popleft()
            try:
                self._deliver(frames, "")
            except Exception:
                log.exception("%s: delivering a message failed", self._address)

    def close(self) -> None:
        self._deliver = None
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
    """Frames through in-memory queues, for the test harness (deterministic, no sleeps)."""

    def __init__(self) -> None:
        self.inboxes: dict[str, _MemoryQueue] = {}

    def bind(self, address: str, role: str = "") -> Inbox:
        if address in self.inboxes:
            raise OSError(f"address in use: {address}")
        inbox = self.inboxes[address] = _MemoryQueue(self, address)
        return inbox

    def connect(self, address: str, peer: str = "", role: str = "") -> Outbox:
        return _MemoryOutbox(self, address)

    def pending(self) -> int:
        return sum(len(q.queue) for q in self.inboxes.values())

    def close(self) -> None:
        self.inboxes.clear()


def free_port(host: str = "127.0.0.1") -> int:
    """A tcp port on ``host`` that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
