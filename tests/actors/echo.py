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
    inbox = (Ping, Count, Sleep, Boom)

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
