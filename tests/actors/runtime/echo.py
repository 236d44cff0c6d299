"""Small actors and messages the runtime tests run in real processes."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import ClassVar

from actorlm.actors.runtime import Actor, handles
from actorlm.messages.base import Message
from actorlm.messages.control import Ping, Pong
from actorlm.messages.envelope import Envelope


class Count(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "test.count"
    n: int


class Item(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "test.item"
    i: int
    pid: int = 0


class Sleep(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "test.sleep"
    seconds: float
    block: bool = False  # block the event loop (a hung actor) instead of awaiting


class Boom(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "test.boom"


class EchoActor(Actor):
    role = "echo"

    @handles(Ping)
    async def on_ping(self, msg: Ping, env: Envelope) -> Pong:
        return Pong(payload=msg.payload)

    @handles(Count)
    async def on_count(self, msg: Count, env: Envelope) -> AsyncIterator[Item]:
        for i in range(msg.n):
            yield Item(i=i, pid=os.getpid())

    @handles(Sleep)
    async def on_sleep(self, msg: Sleep, env: Envelope) -> Item:
        if msg.block:
            time.sleep(msg.seconds)
        else:
            await asyncio.sleep(msg.seconds)
        return Item(i=-1, pid=os.getpid())

    @handles(Boom)
    async def on_boom(self, msg: Boom, env: Envelope) -> None:
        raise RuntimeError("boom")

    def ready_info(self) -> dict[str, int]:
        return {"pid": os.getpid()}


class ClientActor(Actor):
    """The test's own end: no inbox beyond replies."""

    role = "client"


class Ask(Message, frozen=True, kw_only=True):
    """Make the relay request ``Ping(payload)`` from ``to``; it answers the pong's length."""

    TAG: ClassVar[str] = "test.ask"
    to: str
    payload: bytes = b""
    timeout: float = 5.0


class Gather(Message, frozen=True, kw_only=True):
    """Make the relay stream ``Count(n)`` from ``to``; it answers the sum of the items."""

    TAG: ClassVar[str] = "test.gather"
    to: str
    n: int


class RelayActor(Actor):
    """An actor that talks to peers: the harness tests play those peers."""

    role = "relay"

    def __init__(self, config: object = None) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        self.events: list[str] = []

    async def on_start(self) -> None:
        self.events.append("start")

    async def on_stop(self) -> None:
        self.events.append("stop")

    async def on_peer_down(self, role: str, reason: str) -> None:
        self.events.append(f"down:{role}")

    @handles(Ask)
    async def on_ask(self, msg: Ask, env: Envelope) -> Item:
        pong = await self.request(msg.to, Ping(payload=msg.payload), timeout=msg.timeout)
        assert isinstance(pong, Pong)
        return Item(i=len(pong.payload))

    @handles(Gather)
    async def on_gather(self, msg: Gather, env: Envelope) -> Item:
        total = 0
        async for item in self.stream(msg.to, Count(n=msg.n)):
            assert isinstance(item, Item)
            total += item.i
        return Item(i=total)

    @handles(Count)
    async def on_count(self, msg: Count, env: Envelope) -> None:
        """Fire ``n`` items at ``sink``, yielding to the loop between them."""
        for i in range(msg.n):
            await self.send("sink", Item(i=i))
            await asyncio.sleep(0)
