"""Calls in flight: one shared timer still times every request out on its own deadline."""

from __future__ import annotations

import asyncio
import time

import pytest
from actorlm.actors.runtime.calls import ActorDied, ActorError, Calls, RequestTimeout
from actorlm.messages.control import Ack, ErrorReply
from actorlm.messages.envelope import Kind
from actorlm.messages.errors import CallErrorCode


def test_a_short_deadline_behind_a_long_one_still_fires_on_time() -> None:
    async def main() -> None:
        calls = Calls()
        slow = calls.request(1, "worker", "step", timeout=30)
        start = time.monotonic()
        fast = calls.request(2, "worker", "ping", timeout=0.1)
        with pytest.raises(RequestTimeout, match="'worker' did not answer 'ping' within 0.1s"):
            await fast
        assert 0.09 < time.monotonic() - start < 1
        assert not slow.done()
        calls.deliver(1, Kind.REPLY, Ack())
        assert slow.result() == Ack()

    asyncio.run(main())


def test_the_timer_moves_on_when_the_earliest_call_is_answered() -> None:
    async def main() -> None:
        calls = Calls()
        first = calls.request(1, "a", "x", timeout=0.05)
        second = calls.request(2, "a", "y", timeout=0.2)
        calls.deliver(1, Kind.REPLY, Ack())
        calls.finish(1)
        assert first.result() == Ack()
        start = time.monotonic()
        with pytest.raises(RequestTimeout):
            await second
        assert 0.1 < time.monotonic() - start < 1

    asyncio.run(main())


def test_fail_reaches_only_the_calls_to_that_peer() -> None:
    async def main() -> None:
        calls = Calls()
        to_a = calls.request(1, "a", "x", timeout=30)
        to_b = calls.request(2, "b", "x", timeout=30)
        stream = calls.stream(3, "a")
        calls.fail(ActorDied("a died"), to="a")
        with pytest.raises(ActorDied, match="a died"):
            await to_a
        kind, item = stream.get_nowait()
        assert (
            kind == Kind.ERROR
            and isinstance(item, ErrorReply)
            and item.code is CallErrorCode.ACTOR_DIED
        )
        assert not to_b.done()

    asyncio.run(main())


def test_an_actor_error_takes_only_a_code_the_wire_carries() -> None:
    assert ActorError("x", code="not_found").code is CallErrorCode.NOT_FOUND  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="made_up"):
        ActorError("x", code="made_up")  # type: ignore[arg-type]
