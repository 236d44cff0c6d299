"""The unix transport (frames over Unix sockets, no ZMQ) keeps the promises of the ZMQ
PUSH/PULL it stands in for: an outbox queues until its peer binds and across the peer's
restart, big frames and buffers of any item type arrive whole, a plain socket speaking
the documented wire format is heard, and a connection sending garbage is dropped while
the inbox goes on serving the others."""

from __future__ import annotations

import array
import asyncio
import socket
import struct
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from actorlm.actors.runtime.transport import ZmqTransport
from actorlm.actors.runtime.unix import UnixInbox


class Received:
    """What an inbox delivered, and a way to wait for the n-th message."""

    def __init__(self) -> None:
        self.messages: list[list[bytes]] = []
        self._changed = asyncio.Event()

    def __call__(self, frames: list[bytes], identity: str) -> None:
        assert identity == ""
        self.messages.append(frames)
        self._changed.set()

    async def wait_for(self, count: int) -> None:
        async def until() -> None:
            while len(self.messages) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), 10)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


def test_an_outbox_queues_until_its_peer_binds(tmp_path: Path) -> None:
    async def main() -> None:
        transport = ZmqTransport()
        address = f"unix://{tmp_path}/late.sock"
        outbox = transport.connect(address)
        for i in range(3):  # nobody is there yet
            await outbox.send([b"early", str(i).encode()])
        await asyncio.sleep(0.15)  # a reconnect attempt fails meanwhile
        inbox = transport.bind(address)
        got = Received()
        inbox.listen(got)
        await got.wait_for(3)
        assert [m[1] for m in got.messages] == [b"0", b"1", b"2"]
        outbox.close()
        inbox.close()
        transport.close()

    run(main)


def test_what_waits_for_an_absent_peer_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorlm.actors.runtime import unix

    monkeypatch.setattr(unix, "MAX_ABSENT_CHUNKS", 40)

    async def main() -> None:
        transport = ZmqTransport()
        address = f"unix://{tmp_path}/gone.sock"
        outbox = transport.connect(address)
        for i in range(100):  # a heartbeat a beat to an actor that never comes back
            await outbox.send([b"beat", str(i).encode()])
        assert len(outbox._backlog) <= 40  # type: ignore[attr-defined]
        inbox = transport.bind(address)  # it comes after all: the newest arrive, whole
        got = Received()
        inbox.listen(got)
        await got.wait_for(1)
        await asyncio.sleep(0.05)
        assert got.messages[-1] == [b"beat", b"99"]
        assert all(m[0] == b"beat" for m in got.messages)
        outbox.close()
        inbox.close()
        transport.close()

    run(main)


def test_an_outbox_reaches_the_peer_again_after_its_restart(tmp_path: Path) -> None:
    async def main() -> None:
        transport = ZmqTransport()
        address = f"unix://{tmp_path}/peer.sock"
        first, got_first = transport.bind(address), Received()
        first.listen(got_first)
        outbox = transport.connect(address)
        await outbox.send([b"before"])
        await got_first.wait_for(1)
        first.close()  # the peer dies ...
        await asyncio.sleep(0.05)
        await outbox.send([b"while down"])  # ... is sent to while down ...
        second, got_second = transport.bind(address), Received()  # ... and comes back
        second.listen(got_second)
        await outbox.send([b"after"])
        await got_second.wait_for(2)
        assert got_second.messages == [[b"while down"], [b"after"]]
        assert got_first.messages == [[b"before"]]
        outbox.close()
        second.close()
        transport.close()

    run(main)


def test_big_frames_and_typed_buffers_arrive_whole(tmp_path: Path) -> None:
    async def main() -> None:
        transport = ZmqTransport()
        address = f"unix://{tmp_path}/big.sock"
        inbox, got = transport.bind(address), Received()
        inbox.listen(got)
        outbox = transport.connect(address)
        big = bytes(range(256)) * (32 * 1024)  # 8 MiB: far more than a socket buffer
        floats = array.array("f", [0.5 * i for i in range(1000)])  # items of 4 bytes
        reused = bytearray(b"first")
        await outbox.send([b"env", big, memoryview(floats)])
        await outbox.send([b"env", reused])  # queued behind the big one ...
        reused[:] = b"XXXXX"  # ... while its sender reuses the buffer
        await outbox.send([b"", b""])  # empty frames are frames
        await got.wait_for(3)
        assert got.messages[0][0] == b"env" and got.messages[0][1] == big
        assert got.messages[0][2] == floats.tobytes()
        assert got.messages[1] == [b"env", b"first"]
        assert got.messages[2] == [b"", b""]
        outbox.close()
        inbox.close()
        transport.close()

    run(main)


def frame(data: bytes, more: bool) -> bytes:
    return struct.pack("<II", len(data), 1 if more else 0) + data


def test_a_plain_socket_speaking_the_wire_format_is_heard(tmp_path: Path) -> None:
    async def main() -> None:
        path = str(tmp_path / "wire.sock")
        inbox, got = UnixInbox(path), Received()
        inbox.listen(got)
        with socket.socket(socket.AF_UNIX) as peer:
            peer.connect(path)
            wire = frame(b"envelope", True) + frame(b"body", False) + frame(b"alone", False)
            for i in range(len(wire)):  # a byte at a time: frames cross reads
                peer.send(wire[i : i + 1])
                if i % 7 == 0:
                    await asyncio.sleep(0)
            await got.wait_for(2)
        assert got.messages == [[b"envelope", b"body"], [b"alone"]]
        inbox.close()

    run(main)


def test_a_garbage_stream_is_dropped_and_the_inbox_keeps_serving(tmp_path: Path) -> None:
    async def main() -> None:
        transport = ZmqTransport()
        address = f"unix://{tmp_path}/inbox.sock"
        inbox, got = transport.bind(address), Received()
        inbox.listen(got)
        path = address[len("unix://") :]
        with socket.socket(socket.AF_UNIX) as hostile, socket.socket(socket.AF_UNIX) as cut:
            hostile.connect(path)
            hostile.send(struct.pack("<II", 0xFFFFFFFF, 0) + b"junk")  # a 4 GiB "frame"
            cut.connect(path)
            cut.send(frame(b"half a message", True))  # and its sender dies
        outbox = transport.connect(address)
        await outbox.send([b"still", b"served"])
        await got.wait_for(1)
        await asyncio.sleep(0.05)
        assert got.messages == [[b"still", b"served"]]
        with socket.socket(socket.AF_UNIX) as hostile:  # the garbage sender was cut off
            hostile.connect(path)
            hostile.send(struct.pack("<II", 0xFFFFFFFF, 0))
            hostile.settimeout(5)
            assert await asyncio.to_thread(hostile.recv, 1) == b""
        outbox.close()
        inbox.close()
        transport.close()
        assert not Path(path).exists()

    run(main)
