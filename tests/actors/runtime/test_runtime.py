"""The actor runtime across real processes and real ZMQ sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from actorlm.actors.runtime import (
    ActorDied,
    ActorRuntime,
    RemoteError,
    RequestTimeout,
    RuntimeOptions,
)
from actorlm.actors.runtime.supervisor import Launcher
from actorlm.config import DeployConfig, EngineConfig
from actorlm.messages.control import Ping, Pong

from tests.actors.runtime.echo import Boom, ClientActor, Count, EchoActor, Item, Sleep

ECHO = {"echo": "tests.actors.runtime.echo:EchoActor"}


def config(transport: str = "unix", **deploy: object) -> EngineConfig:
    return EngineConfig(deploy=DeployConfig(transport=transport, **deploy))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def cluster(
    cfg: EngineConfig, placement: str = "process"
) -> AsyncIterator[tuple[Launcher, ActorRuntime]]:
    launcher = Launcher(cfg, ECHO, placement=placement)
    await launcher.start(timeout=60)
    client_addr = launcher.new_address("client")
    client = ActorRuntime(
        ClientActor(cfg), client_addr, launcher.transport, RuntimeOptions(request_timeout_s=10)
    )
    launcher.attach(client)
    task = asyncio.create_task(client.serve())
    await client.ready.wait()
    try:
        yield launcher, client
    finally:
        client.stop()
        await task
        await launcher.stop()


def test_the_inbox_is_what_the_handlers_take() -> None:
    assert EchoActor.inbox == (Ping, Count, Sleep, Boom)
    assert EchoActor.handlers[Count] == "on_count"


@pytest.mark.parametrize("transport", ["unix", "ipc", "tcp"])
def test_request_reply_and_stream_across_processes(transport: str) -> None:
    async def main() -> None:
        async with cluster(config(transport)) as (launcher, client):
            assert launcher.book["echo"].startswith(f"{transport}://")
            pong = await client.request("echo", Ping(payload=b"hi"))
            assert pong == Pong(payload=b"hi")
            items = [m async for m in client.stream("echo", Count(n=5))]
            assert [m.i for m in items if isinstance(m, Item)] == [0, 1, 2, 3, 4]
            child_pid = launcher.info("echo")["pid"]
            assert child_pid != os.getpid() and {m.pid for m in items if isinstance(m, Item)} == {
                child_pid
            }
            with pytest.raises(RemoteError, match="boom"):
                await client.request("echo", Boom())
            assert await client.request("echo", Ping()) == Pong()  # still serving

    asyncio.run(main())


def test_inproc_placement_runs_the_same_actor() -> None:
    async def main() -> None:
        async with cluster(config(), placement="inproc") as (launcher, client):
            assert launcher.book["echo"].startswith("inproc://")
            items = [m async for m in client.stream("echo", Count(n=3))]
            assert [m.i for m in items if isinstance(m, Item)] == [0, 1, 2]
            assert {m.pid for m in items if isinstance(m, Item)} == {os.getpid()}

    asyncio.run(main())


def test_request_timeout() -> None:
    async def main() -> None:
        async with cluster(config()) as (_, client):
            start = time.monotonic()
            with pytest.raises(RequestTimeout):
                await client.request("echo", Sleep(seconds=5), timeout=0.3)
            assert time.monotonic() - start < 2
            assert await client.request("echo", Ping()) == Pong()

    asyncio.run(main())


def test_killed_actor_fails_pending_requests_within_a_second() -> None:
    async def main() -> None:
        async with cluster(config()) as (launcher, client):
            pending = asyncio.create_task(client.request("echo", Sleep(seconds=30), timeout=30))
            await asyncio.sleep(0.2)
            os.kill(launcher.info("echo")["pid"], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(ActorDied):
                await pending
            assert time.monotonic() - start < 1.0
            with pytest.raises(ActorDied):  # and new calls fail at once, not after a timeout
                await client.request("echo", Ping(), timeout=30)

    asyncio.run(main())


def test_restart_policy_brings_the_actor_back() -> None:
    async def main() -> None:
        async with cluster(config(max_restarts=1, restart_backoff_s=0.05)) as (launcher, client):
            first = launcher.info("echo")["pid"]
            os.kill(first, signal.SIGKILL)
            for _ in range(200):
                await asyncio.sleep(0.05)
                if "echo" not in client.down and launcher.members["echo"].alive:
                    break
            assert await client.request("echo", Ping(payload=b"again")) == Pong(payload=b"again")
            assert launcher.info("echo")["pid"] != first
            assert launcher.members["echo"].restarts == 1

    asyncio.run(main())


def test_hung_actor_is_detected_by_missed_heartbeats() -> None:
    async def main() -> None:
        cfg = config(heartbeat_s=0.1, peer_timeout_s=0.5)
        async with cluster(cfg) as (launcher, client):
            pending = asyncio.create_task(
                client.request("echo", Sleep(seconds=60, block=True), timeout=60)
            )
            with pytest.raises(ActorDied):
                await asyncio.wait_for(pending, 10)
            assert launcher.members["echo"].process is not None
            assert launcher.members["echo"].process.poll() is not None

    asyncio.run(main())


def test_clean_shutdown_leaves_no_processes_or_sockets() -> None:
    async def main() -> tuple[int, Path]:
        async with cluster(config()) as (launcher, client):
            pid = launcher.info("echo")["pid"]
            run_dir = Path(launcher.run_dir)
            assert any(run_dir.glob("*.sock"))
            await client.request("echo", Ping())
        return pid, run_dir

    pid, run_dir = asyncio.run(main())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not run_dir.exists()


@pytest.mark.parametrize("transport", ["unix", "ipc"])
def test_bad_messages_get_an_error_and_the_actor_keeps_serving(transport: str) -> None:
    from actorlm.messages.envelope import Envelope, Kind

    async def main() -> None:
        async with cluster(config(transport)) as (launcher, client):
            outbox = launcher.transport.connect(launcher.book["echo"])
            enc = msgspec.msgpack.encode
            addr = client.address
            await outbox.send([b"\xc1garbage", b""])  # not even an envelope
            await outbox.send(
                [enc(Envelope("nope.nothing", 10**9, "client", Kind.SEND, 0, addr)), enc({})]
            )
            await outbox.send(
                [
                    enc(Envelope("test.count", 10**9 + 1, "client", Kind.SEND, 0, addr)),
                    enc({"n": "x"}),
                ]
            )
            assert await client.request("echo", Ping(payload=b"ok")) == Pong(payload=b"ok")
            outbox.close()

    asyncio.run(main())


def test_a_stable_actor_restarts_at_once_and_a_crash_loop_backs_off() -> None:
    async def main() -> None:
        launcher = Launcher(config(restart_backoff_s=0.5, max_restarts=10), ECHO)
        try:
            member = launcher.members["echo"]
            delays = []
            for lived in (60.0, 1.0, 2.0, 0.0, 30.0, 0.5):
                # READY `lived` seconds ago (0: it died before it was ready)
                member.ready_at = time.monotonic() - lived if lived else 0.0
                delays.append(launcher._restart_delay(member))
            # killed after serving: at once; dying soon after each start: 0.5 s, doubling
            assert delays == [0.0, 0.5, 1.0, 2.0, 0.0, 0.5]
        finally:
            launcher.transport.close()
            shutil.rmtree(launcher.run_dir)

    asyncio.run(main())
