"""Frames over Unix stream sockets without ZMQ: the ``unix://`` transport.

ZMQ hands every message to an I/O thread at each end, so a message between two
actors wakes four threads. On a small host whose cores a forward pass fills,
those wake-ups cost more than the message: a ping-pong between two processes
takes 93 us of CPU a round trip over ZMQ ipc and 14 us over a plain Unix socket
(``bench/actor_rtt.py`` compares them). Here the sender writes from its event
loop and the receiver reads in its loop's reader callback: a syscall at each end.

Wire: a frame is an 8-byte header (little-endian u32 length, u32 flags, bit 0
"more frames follow") and its bytes; a message is its frames up to the first
without "more". A non-Python peer speaks it in a few lines.

It behaves as the ZMQ PUSH/PULL pair it stands in for: an outbox queues while its
peer is not there yet (or restarting) and tries again every ``RECONNECT_S``; what
it wrote to a peer that then died is lost with that peer; an inbox takes any
number of outboxes, each one's messages in order. Only processes that can open
the socket file reach it, so it lives in an owner-only run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["FrameError", "RECONNECT_S", "UnixInbox", "UnixOutbox", "clear_socket_path", "unix_path"]

log = logging.getLogger(__name__)

RECONNECT_S = 0.1  # as ZMQ's default reconnect interval
MAX_FRAME = 1 << 31  # a larger length is a broken stream, not a frame
_HEADER = struct.Struct("<II")
_MORE = 1
_READ_CHUNK = 256 * 1024
_MAX_IOV = 512  # buffers a sendmsg (IOV_MAX is 1024 on Linux)
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
# Chunks (a frame's header and its bytes) kept for a peer that is not there: past this
# (~25,000 small messages: hours of heartbeats to an actor that is down for good) they
# are dropped. Whatever comes back is a new incarnation, which drops them anyway.
MAX_ABSENT_CHUNKS = 100_000
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionRefusedError, FileNotFoundError)


class FrameError(ValueError):
    """The byte stream is not frames: the connection is dropped."""


def unix_path(address: str) -> str | None:
    return address[len("unix://") :] if address.startswith("unix://") else None


def clear_socket_path(path: str) -> None:
    """Make ``path``'s folder, and take away a socket file a crashed run left there."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _Reader:
    """One accepted connection: bytes in, whole messages out."""

    __slots__ = ("sock", "buf", "parts")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.parts: list[bytes] = []

    def feed(self, data: bytes | memoryview) -> list[list[bytes]]:
        buf = self.buf
        buf += data
        messages: list[list[bytes]] = []
        pos, end = 0, len(buf)
        with memoryview(buf) as view:  # a frame's bytes copied once (a slice of buf: twice)
            while end - pos >= _HEADER.size:
                length, flags = _HEADER.unpack_from(view, pos)
                if length > MAX_FRAME:
                    raise FrameError(f"a frame header says {length} bytes")
                stop = pos + _HEADER.size + length
                if stop > end:
                    break
                self.parts.append(view[pos + _HEADER.size : stop].tobytes())
                pos = stop
                if not flags & _MORE:
                    messages.append(self.parts)
                    self.parts = []
        del buf[:pos]  # the view released: buf may shrink
        return messages


class UnixInbox:
    """A listening Unix socket read straight off the event loop.

    Bound at once (connections wait in the kernel's backlog), read from ``listen``
    on: each accepted connection has a reader callback that hands every whole
    message to ``deliver`` in arrival order.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        clear_socket_path(path)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(256)
        self._server.setblocking(False)
        self._readers: dict[int, _Reader] = {}
        # Read into one buffer, kept: a fresh 256 KiB bytes object a read cost ~9 us
        # (an mmap and munmap each time), against ~1 us for the read and its copy here.
        self._chunk = memoryview(bytearray(_READ_CHUNK))
        self._deliver: Callable[[list[bytes], str], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def listen(self, deliver: Callable[[list[bytes], str], None]) -> None:
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._server.fileno(), self._accept)
        self._accept()

    def _accept(self) -> None:
        assert self._loop is not None
        while True:
            try:
                sock, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the backlog keeps them
                log.warning("%s: accepting a connection failed: %s", self._path, exc)
                return
            sock.setblocking(False)
            reader = self._readers[sock.fileno()] = _Reader(sock)
            self._loop.add_reader(sock.fileno(), self._read, reader)

    def _read(self, reader: _Reader) -> None:
        try:
            n = reader.sock.recv_into(self._chunk)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:  # the sender closed or died
            self._drop(reader)
            return
        try:
            messages = reader.feed(self._chunk[:n])
        except FrameError as exc:
            log.error("%s: dropping a connection that sent no frames: %s", self._path, exc)
            self._drop(reader)
            return
        for parts in messages:
            if self._deliver is None:  # closed by an earlier delivery
                return
            try:
                self._deliver(parts, "")
            except Exception:
                log.exception("unix://%s: delivering a message failed", self._path)

    def _drop(self, reader: _Reader) -> None:
        fd = reader.sock.fileno()
        if self._loop is not None and fd >= 0:
            self._loop.remove_reader(fd)
        self._readers.pop(fd, None)
        reader.sock.close()

    def close(self) -> None:
        self._deliver = None
        for reader in list(self._readers.values()):
            self._drop(reader)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._server.fileno())
        self._server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)


class UnixOutbox:
    """A connection to one inbox, made at the first send and again after the peer
    went away; sends never wait: what the socket does not take at once (the peer
    is slow, absent or restarting) is kept in order and written when it can be (for an
    absent peer, up to ``MAX_ABSENT_CHUNKS``)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._backlog: deque[memoryview] = deque()  # written before anything new
        self._retry: asyncio.TimerHandle | None = None
        self._writing = False  # a writer callback is waiting for room
        self._closed = False

    async def send(self, frames: Sequence[bytes | memoryview]) -> None:
        if self._closed:
            raise ConnectionError(f"unix://{self._path}: the outbox is closed")
        chunks: list[memoryview] = []
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            view = memoryview(frame)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            chunks.append(memoryview(_HEADER.pack(view.nbytes, 0 if i == last else _MORE)))
            if view.nbytes:  # no empty chunk: a backlog of one would never drain
                chunks.append(view)
        if self._sock is None and self._retry is None:  # not connected, no attempt due
            self._loop = asyncio.get_running_loop()
            self._connect()
        if self._sock is None or self._backlog:
            if self._sock is None and len(self._backlog) >= MAX_ABSENT_CHUNKS:
                log.warning(
                    "unix://%s: the peer has been away for %d chunks; dropping them",
                    self._path,
                    len(self._backlog),
                )
                self._backlog.clear()  # whole messages: nothing is half sent while absent
            # Copied: the caller may reuse its buffers before they are written.
            self._backlog.extend(memoryview(bytes(c)) for c in chunks)
            return
        self._write(chunks)

    def _write(self, chunks: list[memoryview]) -> None:
        """Write ``chunks`` now, keeping what the socket does not take."""
        assert self._sock is not None
        try:
            sent = self._sock.sendmsg(chunks, [], _NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except _GONE:
            self._backlog.extend(memoryview(bytes(c)) for c in chunks)
            self._disconnected()
            return
        for chunk in chunks:
            if sent >= chunk.nbytes:
                sent -= chunk.nbytes
                continue
            self._backlog.append(memoryview(bytes(chunk[sent:])))
            sent = 0
        if self._backlog:
            self._wait_for_room()

    def _flush(self) -> None:
        self._writing = False
        if self._sock is None:
            return
        while self._backlog:
            chunks = [self._backlog[i] for i in range(min(len(self._backlog), _MAX_IOV))]
            try:
                sent = self._sock.sendmsg(chunks, [], _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                break
            except _GONE:
                self._disconnected()
                return
            while sent:
                head = self._backlog[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    self._backlog.popleft()
                else:
                    self._backlog[0] = head[sent:]
                    sent = 0
        if self._backlog:
            self._wait_for_room()
        elif self._loop is not None:
            self._loop.remove_writer(self._sock.fileno())

    def _wait_for_room(self) -> None:
        if not self._writing and self._sock is not None and self._loop is not None:
            self._writing = True
            self._loop.add_writer(self._sock.fileno(), self._flush)

    def _connect(self) -> None:
        self._retry = None
        if self._closed:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(self._path)
        except OSError as exc:  # not bound yet, gone, or its backlog full: later
            sock.close()
            if not isinstance(exc, _GONE) and exc.errno not in (errno.EAGAIN, errno.ENOENT):
                log.warning("unix://%s: connecting failed: %s", self._path, exc)
            self._schedule_connect()
            return
        assert self._loop is not None
        self._sock = sock
        # The inbox never writes back: readable means the peer closed (or died).
        self._loop.add_reader(sock.fileno(), self._on_peer_closed)
        if self._backlog:
            self._flush()

    def _schedule_connect(self) -> None:
        if self._retry is None and self._loop is not None and not self._closed:
            self._retry = self._loop.call_later(RECONNECT_S, self._connect)

    def _on_peer_closed(self) -> None:
        if self._sock is None:
            return
        try:
            data = self._sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._disconnected()

    def _disconnected(self) -> None:
        """The peer went away: drop the socket, and connect again for what waits."""
        self._drop_socket()
        if self._backlog:  # else the next send connects
            self._schedule_connect()

    def _drop_socket(self) -> None:
        sock, self._sock = self._sock, None
        self._writing = False
        if sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(sock.fileno())
            self._loop.remove_writer(sock.fileno())
        sock.close()

    def close(self) -> None:
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._drop_socket()
        self._backlog.clear()
