"""The public actor test harness, on real actors, the real codec and real interceptors."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import pytest
from actorlm.actors.roles import ACTOR_ROLES
from actorlm.actors.runtime import Actor, RemoteError, handles
from actorlm.actors.runtime.harness import ActorHarness, check_inbox
from actorlm.config import EngineConfig
from actorlm.extensions.interceptors import DROP, InterceptContext, Interceptor, Reject
from actorlm.messages.base import Message
from actorlm.messages.control import Ack, Ping, Pong, Shutdown
from actorlm.messages.envelope import Envelope, Kind
from actorlm.messages.errors import CallErrorCode

from tests.actors.runtime.echo import Ask, Count, EchoActor, Gather, Item, RelayActor


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "role", ["tokenizer", "scheduler", "cache_manager", "worker", "lora_loader", "gateway"]
)
def test_every_builtin_handler_can_run(role: str) -> None:
    check_inbox(ACTOR_ROLES.get(role))


def test_every_handler_can_run() -> None:
    check_inbox(EchoActor)
    check_inbox(RelayActor)

    class Untagged(Message, frozen=True, kw_only=True):
        n: int = 0

    class Deaf(Actor):
        role = "deaf"

        @handles(Ping)
        async def on_ping(self, msg: Ping, env: Envelope) -> None:
            return None

        @handles(Shutdown)  # the runtime answers Shutdown itself
        async def on_shutdown(self, msg: Shutdown, env: Envelope) -> None:
            return None

        @handles(Untagged)  # no TAG: it never decodes
        async def on_untagged(self, msg: Untagged, env: Envelope) -> None:
            return None

    with pytest.raises(AssertionError, match="on_shutdown .*on_untagged") as err:
        check_inbox(Deaf)
    assert "on_ping" not in str(err.value)


def test_the_handlers_are_the_one_declaration() -> None:
    class Base(Actor):
        role = "base"

        @handles(Ping, Count)
        async def on_either(self, msg: Message, env: Envelope) -> None:
            return None

    class Child(Base):
        @handles(Count)
        async def on_count(self, msg: Count, env: Envelope) -> None:
            return None

    assert Base.inbox == (Ping, Count) and Child.inbox == (Ping, Count)
    assert Child.handlers == {Ping: "on_either", Count: "on_count"}  # the child's replaces

    with pytest.raises(TypeError, match="inbox"):

        class Listed(Actor):
            inbox = (Ping,)

    with pytest.raises(TypeError, match="Ping twice"):

        class Twice(Actor):
            @handles(Ping)
            async def a(self, msg: Ping, env: Envelope) -> None:
                return None

            @handles(Ping)
            async def b(self, msg: Ping, env: Envelope) -> None:
                return None


def test_lifecycle_hooks_run_on_enter_and_exit() -> None:
    async def main() -> RelayActor:
        actor = RelayActor(EngineConfig())
        async with ActorHarness(actor):
            assert actor.events == ["start"]
        return actor

    assert run(main()).events == ["start", "stop"]


def test_inject_and_capture_per_peer() -> None:
    async def main() -> None:
        async with ActorHarness(RelayActor(EngineConfig())) as h:
            await h.send(Count(n=3), sender="client")
            assert h.sent("sink") == [Item(i=0), Item(i=1), Item(i=2)]
            assert h.sent_types("sink") == [Item, Item, Item]
            assert h.sent("client") == []  # a send gets no reply
            records = h.sent_records("sink")
            assert {r.kind for r in records} == {Kind.SEND} and records[0].env.sender == "relay"
            h.clear("sink")
            assert h.sent() == []
            # A request's reply is captured too, addressed to the injecting peer.
            async with ActorHarness(EchoActor(EngineConfig())) as echo:
                assert await echo.request(Ping(payload=b"x"), sender="gateway") == Pong(
                    payload=b"x"
                )
                assert echo.sent("gateway") == [Pong(payload=b"x")]
                assert echo.sent_records("gateway")[0].kind == Kind.REPLY

    run(main())


def test_scripted_peer_answers_the_actors_requests() -> None:
    async def main() -> None:
        async with ActorHarness(RelayActor(EngineConfig())) as h:
            h.on("worker", Ping, lambda m: Pong(payload=m.payload * 2))
            assert await h.request(Ask(to="worker", payload=b"abc"), sender="gateway") == Item(i=6)
            assert h.sent_types("worker") == [Ping]

            async def slow(m: Ping) -> Pong:
                await asyncio.sleep(0)
                return Pong(payload=b"async")

            h.on("cache", Ping, slow)
            assert await h.request(Ask(to="cache"), sender="gateway") == Item(i=5)

            def broken(m: Ping) -> Pong:
                raise ValueError("worker exploded")

            h.on("worker", Ping, broken)
            with pytest.raises(RemoteError, match="worker exploded"):
                await h.request(Ask(to="worker"), sender="gateway")

    run(main())


def test_unscripted_request_is_answered_by_the_test() -> None:
    async def main() -> None:
        async with ActorHarness(RelayActor(EngineConfig())) as h:
            pending = asyncio.create_task(h.request(Ask(to="worker"), sender="gateway"))
            await h.settle()
            [record] = h.sent_records("worker", kinds=[Kind.REQUEST])
            assert not pending.done()
            await h.reply(record, Pong(payload=b"four"))
            assert await pending == Item(i=4)

    run(main())


def test_streaming_both_ways() -> None:
    async def main() -> None:
        async with ActorHarness(EchoActor(EngineConfig())) as h:
            items = [m async for m in h.stream(Count(n=4), sender="gateway")]
            assert items == [Item(i=i, pid=items[0].pid) for i in range(4)]  # type: ignore[attr-defined]
        async with ActorHarness(RelayActor(EngineConfig())) as h:

            async def counter(m: Count) -> Any:
                for i in range(m.n):
                    yield Item(i=i)

            h.on("worker", Count, counter)
            assert await h.request(Gather(to="worker", n=5), sender="gateway") == Item(i=10)
            assert [r.kind for r in h.sent_records("gateway")] == [Kind.REPLY]

    run(main())


def guard(msg: Ping, ctx: InterceptContext) -> Ping | None:
    if msg.payload == b"bad":
        raise Reject("payload 'bad' is not allowed")
    if msg.payload == b"quiet":
        return DROP
    if msg.payload.islower():
        return msgspec.structs.replace(msg, payload=msg.payload.upper())
    return None


def stamp(msg: Pong, ctx: InterceptContext) -> Pong:
    return Pong(payload=msg.payload + f"@{ctx.peer}".encode())


def test_interceptor_rewrites_and_rejects() -> None:
    async def main() -> None:
        chain = [
            Interceptor("echo", Ping, "in", guard, "test-plugin"),
            Interceptor("echo", Pong, "out", stamp, "test-plugin"),
        ]
        async with ActorHarness(EchoActor(EngineConfig()), interceptors=chain) as h:
            assert await h.request(Ping(payload=b"hi"), sender="gw") == Pong(payload=b"HI@gw")
            with pytest.raises(RemoteError, match="payload 'bad' is not allowed") as info:
                await h.request(Ping(payload=b"bad"), sender="gw")
            assert info.value.code is CallErrorCode.REJECTED and info.value.status == 400
            with pytest.raises(RemoteError, match="not allowed"):  # a plain send hears it too
                await h.send(Ping(payload=b"bad"), sender="gw")
            h.clear()
            await h.send(Ping(payload=b"quiet"), sender="gw")  # dropped: no reply, no error
            assert h.sent() == []

    run(main())


def test_peer_down_fails_the_actors_pending_request() -> None:
    async def main() -> None:
        actor = RelayActor(EngineConfig())
        async with ActorHarness(actor) as h:
            pending = asyncio.create_task(h.request(Ask(to="worker", timeout=30), sender="gw"))
            await h.settle()
            assert h.sent_types("worker") == [Ping]
            await h.peer_down("worker", reason="SIGKILL")
            with pytest.raises(RemoteError, match="SIGKILL") as info:
                await pending
            assert info.value.code is CallErrorCode.ACTOR_DIED
            assert actor.events[-1] == "down:worker"
            with pytest.raises(RemoteError, match="down"):  # new calls fail at once
                await h.request(Ask(to="worker", timeout=30), sender="gw")
            await h.peer_up("worker")
            h.on("worker", Ping, lambda m: Pong(payload=b"ok"))
            assert await h.request(Ask(to="worker"), sender="gw") == Item(i=2)

    run(main())


def test_settle_runs_to_idle_without_sleeping() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        async with ActorHarness(RelayActor(EngineConfig())) as h:
            start = loop.time()
            await h.send(Count(n=200), sender="client", settle=False)
            await h.settle()
            elapsed = loop.time() - start
            assert [m.i for m in h.sent("sink")] == list(range(200))  # type: ignore[attr-defined]
            await h.settle()  # idle already: returns at once
        return elapsed

    assert run(main()) < 2.0


def test_bad_frames_leave_the_actor_serving() -> None:
    async def main() -> None:
        async with ActorHarness(EchoActor(EngineConfig())) as h:
            await h.inject_frames([b"\xc1nonsense", b""])
            enc = msgspec.msgpack.encode
            await h.inject_frames(
                [
                    enc(Envelope("test.count", 99, "gw", Kind.REQUEST, 0, "harness://gw")),
                    enc({"n": "x"}),
                ]
            )
            await h.settle()
            [error] = h.sent("gw")
            assert getattr(error, "code", "") is CallErrorCode.BAD_MESSAGE and "n" in getattr(
                error, "message", ""
            )
            assert await h.request(Ping(), sender="gw") == Pong()
            assert (
                await h.request(Count(n=0), sender="gw") == Ack()
            )  # an empty stream ends with its END marker

    run(main())


def test_a_failing_on_failure_or_on_stop_is_logged_with_the_role(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Clumsy(Actor):
        role = "clumsy"

        @handles(Ping)
        async def on_ping(self, msg: Ping, env: Envelope) -> None:
            raise RuntimeError("the handler broke")

        async def on_failure(self, exc: BaseException, msg: Message | None) -> None:
            raise RuntimeError("on_failure broke too")

        async def on_stop(self) -> None:
            raise RuntimeError("on_stop broke")

    async def main() -> None:
        async with ActorHarness(Clumsy(EngineConfig())) as harness:
            with pytest.raises(RemoteError, match="the handler broke"):
                await harness.request(Ping(payload=b""))
            await harness.settle()

    with caplog.at_level(logging.ERROR, logger="actorlm.actors.runtime.dispatch"):
        run(main())
    logged = {r.getMessage(): r.exc_info for r in caplog.records}
    assert "clumsy: on_failure failed" in logged and "clumsy: on_stop failed" in logged
    failure, stop = logged["clumsy: on_failure failed"], logged["clumsy: on_stop failed"]
    assert failure is not None and "on_failure broke too" in str(failure[1])
    assert stop is not None and "on_stop broke" in str(stop[1])


def test_a_refused_oversized_message_is_freed_at_once() -> None:
    """A message over the size limit is refused, and its frames are not kept alive by
    the error (a cycle only the cyclic collector would free: 300 MB a message)."""
    import gc
    import weakref

    class Buffer(bytearray):  # bytes, but one a weak reference can watch
        pass

    async def main() -> None:
        async with ActorHarness(EchoActor(EngineConfig())) as h:
            h.runtime.codec.max_message_bytes = 1 << 16
            enc = msgspec.msgpack.encode
            env = enc(Envelope(Ping.TAG, 10**9, "test", Kind.SEND))
            big = Buffer(1 << 17)
            watch = weakref.ref(big)
            gc.disable()
            try:
                h.runtime._on_frames([env, enc(Ping()), big])
                del big
                await asyncio.sleep(0.05)  # the slow lane logs and drops it
                assert watch() is None
            finally:
                gc.enable()
            assert await h.request(Ping(payload=b"ok")) == Pong(payload=b"ok")

    run(main())
