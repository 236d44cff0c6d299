"""Inboxes (ZMQ's and the unix transport's) deliver every message once, in order, whether
it comes alone or in a burst; an outbox to an inproc peer that is gone fails at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from actorlm.actors.runtime.transport import ZmqTransport


@pytest.mark.parametrize("scheme", ["ipc", "unix"])
@pytest.mark.parametrize("burst", [1, 1000])
def test_inbox_delivers_bursts_in_order(tmp_path: Path, burst: int, scheme: str) -> None:
    async def main() -> list[list[bytes]]:
        transport = ZmqTransport()
        address = f"{scheme}://{tmp_path}/inbox.sock"
        inbox = transport.bind(address)
        outbox = transport.connect(address)
        got: list[list[bytes]] = []
        done = asyncio.Event()

        def deliver(frames: list[bytes], identity: str) -> None:
            got.append(frames)
            if len(got) == 2 * burst:
                done.set()

        await outbox.send([b"early", b"0"])  # queued before anyone listens
        inbox.listen(deliver)
        for i in range(1, burst):
            await outbox.send([b"first", str(i).encode()])
        await asyncio.sleep(0.05)
        for i in range(burst, 2 * burst):
            await outbox.send([b"second", str(i).encode(), b"x" * 100_000])
        await asyncio.wait_for(done.wait(), 10)
        outbox.close()
        inbox.close()
        transport.close()
        return got

    got = asyncio.run(main())
    assert [int(frames[1]) for frames in got] == list(range(2 * burst))
    assert all(len(frames) == 3 and len(frames[2]) == 100_000 for frames in got[burst:])


def test_an_inproc_peer_gone_is_an_error_at_once_not_a_wait() -> None:
    async def main() -> None:
        transport = ZmqTransport()
        outbox = transport.connect("inproc://peer")
        await outbox.send([b"queued", b"before the peer binds"])  # inproc queues for it
        inbox = transport.bind("inproc://peer")
        got = asyncio.Event()
        inbox.listen(lambda frames, identity: got.set())
        await asyncio.wait_for(got.wait(), 5)
        inbox.close()  # the peer dies: its pipe is gone for good
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(outbox.send([b"after", b"its death"]), 5)
        outbox.close()
        transport.close()

    asyncio.run(main())
