"""Liveness between peers: the pure peer table, and the runtime's use of incarnations
over real frames (a fake peer speaks the wire format to a real ActorRuntime)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from actorlm.actors.runtime import ActorDied, ActorRuntime, RuntimeOptions
from actorlm.actors.runtime.peers import ChangeKind, PeerTable
from actorlm.actors.runtime.transport import MemoryTransport
from actorlm.config import EngineConfig
from actorlm.messages.control import Heartbeat, Ping, Pong, Shutdown
from actorlm.messages.envelope import Codec, Envelope, Kind
from actorlm.messages.errors import CallErrorCode

from tests.actors.runtime.echo import EchoActor


def test_silence_restart_and_dead_incarnations() -> None:
    table = PeerTable(timeout_s=3.0)
    first = table.heard("worker", 11, now=0.0)
    assert first is not None and first.kind is ChangeKind.UP
    assert table.heard("worker", 11, now=1.0) is None
    assert table.expire(now=3.5) == []  # silent 2.5 s: fine
    (down,) = table.expire(now=4.5)
    assert down.kind is ChangeKind.DOWN and "no message" in down.reason
    assert table.down == {"worker"}
    back = table.heard("worker", 11, now=5.0)  # only slow: the same incarnation comes back
    assert back is not None and back.kind is ChangeKind.UP and table.down == set()
    restarted = table.heard("worker", 22, now=6.0)  # its death went unnoticed
    assert restarted is not None and restarted.kind is ChangeKind.RESTARTED
    assert table.is_stale("worker", 11) and not table.is_stale("worker", 22)
    assert table.mark_down("worker", "process exited", 22) is not None
    assert table.mark_down("worker", "again", 22) is None  # once is enough
    up = table.heard("worker", 33, now=7.0)  # a successor whose predecessor's death is known
    assert up is not None and up.kind is ChangeKind.UP
    table.forgive(now=100.0)  # our own loop stalled: nobody is blamed for it
    assert table.expire(now=101.0) == []


def test_a_claimed_successor_that_falls_silent_gives_its_predecessor_back() -> None:
    # One frame claiming a new incarnation (forged, or from a process that died at once)
    # must not make the live incarnation's messages stale for good.
    table = PeerTable(timeout_s=3.0)
    table.heard("worker", 11, now=0.0)
    claim = table.heard("worker", 99, now=1.0)
    assert claim is not None and claim.kind is ChangeKind.RESTARTED
    assert table.is_stale("worker", 11)  # while the claimed successor may be alive
    (down,) = table.expire(now=4.5)  # ... it never spoke again
    assert down.kind is ChangeKind.DOWN
    assert not table.is_stale("worker", 11)  # the replaced one, heard again, is back
    back = table.heard("worker", 11, now=5.0)
    assert back is not None and back.kind is ChangeKind.UP and back.incarnation == 11
    assert table.is_stale("worker", 99) and not table.is_stale("worker", 11)
    # an incarnation reported dead (its process exited) stays dead, successor or not
    table.mark_down("worker", "process exited", 11)
    table.heard("worker", 12, now=6.0)
    table.expire(now=10.0)
    assert table.is_stale("worker", 11)


class FakePeer:
    """Speaks the wire format to the runtime under test as role ``name``."""

    def __init__(self, transport: MemoryTransport, name: str, target: str) -> None:
        self.name, self.address = name, f"memory://{name}"
        self.inbox = transport.bind(self.address)
        self.received: list[tuple[Envelope, object]] = []
        self.inbox.listen(lambda frames, _: self.received.append(self.codec.decode(frames)))
        self.out = transport.connect(target)
        self.codec = Codec()
        self.incarnation = 1001
        self.ids = iter(range(1, 10**6))

    async def send(
        self, msg: object, kind: Kind = Kind.SEND, reply_to: int = 0, to: int = 0
    ) -> int:
        msg_id = next(self.ids)
        env = Envelope(
            msg.TAG,  # type: ignore[attr-defined]
            msg_id,
            self.name,
            kind,
            reply_to,
            self.address,
            self.incarnation,
            to,
        )
        await self.out.send(self.codec.encode(env, msg))  # type: ignore[arg-type]
        return msg_id


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_replies_from_a_dead_incarnation_are_dropped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        transport = MemoryTransport()
        options = RuntimeOptions(request_timeout_s=5, controller="boss")
        runtime = ActorRuntime(EchoActor(EngineConfig()), "memory://echo", transport, options)
        peer = FakePeer(transport, "worker", "memory://echo")
        runtime.book["worker"] = peer.address
        serving = asyncio.create_task(runtime.serve())
        await runtime.ready.wait()
        old = peer.incarnation
        await peer.send(Heartbeat(role="worker", pid=1))
        await _settle()
        assert runtime.peer_incarnation("worker") == old
        # A request to the peer; it dies, and its successor says hello before any reply.
        call = asyncio.create_task(runtime.request("worker", Ping(payload=b"x")))
        await _settle()
        (sent_env, _), *_ = [r for r in peer.received if r[0].tag == Ping.TAG]
        assert sent_env.to_incarnation == old  # addressed to the incarnation it knew
        peer.incarnation = old + 1
        await peer.send(Heartbeat(role="worker", pid=2))
        with pytest.raises(ActorDied):
            await asyncio.wait_for(call, 2)  # the call to the dead one failed at once
        # The dead incarnation's late reply is dropped, and said to be.
        peer.incarnation = old
        with caplog.at_level(logging.WARNING):
            await peer.send(Pong(payload=b"x"), kind=Kind.REPLY, reply_to=sent_env.id)
            await _settle()
        assert "from a dead incarnation of worker" in caplog.text
        # A request addressed to an earlier incarnation of the echo actor is refused.
        peer.incarnation = old + 1
        peer.received.clear()
        await peer.send(Ping(payload=b"y"), kind=Kind.REQUEST, to=runtime.incarnation + 1)
        await _settle()
        (reply_env, reply), *_ = peer.received
        assert reply_env.kind == Kind.ERROR and reply.code is CallErrorCode.STALE_INCARNATION  # type: ignore[attr-defined]
        # Control messages from anyone but the supervisor are not obeyed.
        await peer.send(Shutdown(reason="forged"))
        await _settle()
        assert not serving.done() and "obeyed only from the supervisor" in caplog.text
        await peer.send(Ping(payload=b"z"), kind=Kind.REQUEST)
        await _settle()
        assert any(isinstance(m, Pong) and m.payload == b"z" for _, m in peer.received)
        runtime.stop()
        await serving

    asyncio.run(main())


def test_a_client_that_introduced_itself_is_forgotten_once_gone() -> None:
    async def main() -> None:
        transport = MemoryTransport()
        options = RuntimeOptions(heartbeat_s=0.02, peer_timeout_s=0.2)
        runtime = ActorRuntime(EchoActor(EngineConfig()), "memory://echo", transport, options)
        serving = asyncio.create_task(runtime.serve())
        await runtime.ready.wait()
        client = FakePeer(transport, "client-1", "memory://echo")
        await client.send(Ping(payload=b"x"), kind=Kind.REQUEST)
        await _settle()
        assert runtime.book["client-1"] == client.address  # learned from its reply address
        await asyncio.sleep(0.5)  # it left without a word: down, then forgotten
        assert "client-1" not in runtime.book
        await client.send(Ping(payload=b"y"), kind=Kind.REQUEST)  # back: known again
        await _settle()
        assert "client-1" in runtime.book
        runtime.stop()
        await serving

    asyncio.run(main())
