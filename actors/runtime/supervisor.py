"""The launcher: starts a set of actors, in one process or one process each,
waits for every READY, watches liveness, restarts, and shuts down cleanly.

Placement is configuration: ``placement="process"`` spawns one process per
actor (ipc or tcp addresses), ``"inproc"`` runs them all on this event loop
(inproc addresses; tests and notebooks). The code of the actors is the same.

A death is noticed two ways: the process exits (its pidfd becomes readable,
within milliseconds), or its heartbeats stop for ``heartbeat_s *
heartbeat_misses`` (it hangs; it is then killed). Either way every actor and
attached client hears ``PeerDown`` at once and fails what it had pending on the
dead one, and the role is restarted if ``deploy.restart[role]`` allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...config import EngineConfig
from ...extensions.registry import Registry, get_registry, import_object
from ...messages.base import Message
from ...messages.control import Heartbeat, PeerDown, PeerUp, Ready, Shutdown
from ...messages.envelope import Envelope
from .dispatch import Actor, ActorError, ActorRuntime, RuntimeOptions, handles
from .transport import ZmqTransport, free_port

__all__ = ["ACTOR_ROLES", "Launcher", "StartupError", "make_addresses", "run_actor"]

log = logging.getLogger(__name__)

ACTOR_ROLES: Registry[type[Actor]] = get_registry("actor role", "actorlm actor ROLE")


class StartupError(RuntimeError):
    pass


def make_addresses(roles: list[str], transport: str, run_dir: str) -> dict[str, str]:
    """A fresh address per role for ``transport`` (inproc | ipc | tcp on loopback)."""
    if transport == "inproc":
        tag = uuid.uuid4().hex[:8]
        return {r: f"inproc://actorlm-{tag}-{r}" for r in roles}
    if transport == "ipc":
        return {r: f"ipc://{run_dir}/{r}.sock" for r in roles}
    if transport == "tcp":
        return {r: f"tcp://127.0.0.1:{free_port()}" for r in roles}
    raise ValueError(f"unknown transport {transport!r}; known: inproc, ipc, tcp")


def build_actor(spec: str, config: EngineConfig) -> Actor:
    """``spec`` is a registered role name or a ``"module:Class"`` path."""
    if ":" in spec:
        cls = import_object(spec)
    else:
        from .. import roles  # noqa: F401  (registers the built-in roles)

        cls = ACTOR_ROLES.get(spec)
    return cls(config)


async def run_actor(
    spec: str,
    config: EngineConfig,
    address: str,
    book: dict[str, str],
    supervisor: str = "",
    parent_pid: int = 0,
    *,
    bind: str = "",
) -> None:
    """Run one actor until it is told to stop (or its parent process is gone)."""
    transport = ZmqTransport()
    options = RuntimeOptions(
        request_timeout_s=config.deploy.request_timeout_s,
        heartbeat_s=config.deploy.heartbeat_s,
        max_message_bytes=config.deploy.max_message_bytes,
        supervisor=supervisor,
        book=book,
        bind=bind,
    )
    actor = build_actor(spec, config)
    role = actor.role
    runtime = ActorRuntime(actor, address, transport, options)
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, runtime.stop)

    async def orphan_watch() -> None:
        while parent_pid and os.getppid() == parent_pid:
            await asyncio.sleep(0.5)
        if parent_pid:
            log.warning("%s: parent %d is gone; stopping", role, parent_pid)
            runtime.stop()

    watch = asyncio.create_task(orphan_watch())
    try:
        await runtime.serve()
    finally:
        watch.cancel()
        transport.close()


class ChildSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a spawned actor process reads from its stdin."""

    spec: str
    config: EngineConfig
    address: str
    book: dict[str, str]
    supervisor: str
    parent: int
    sys_path: list[str]


def child_main() -> None:
    """Entry of ``python -m actorlm.actors.child``: one actor, told what to be on stdin.

    A fresh interpreter (not multiprocessing's spawn) so the parent's ``__main__``
    is never re-imported: scripts without an ``if __name__ == "__main__"`` guard work.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    child = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=ChildSpec)
    sys.path[:] = list(dict.fromkeys([*child.sys_path, *sys.path]))
    from .process import event_loop_runner, prepare_process

    prepare_process(child.config, child.spec)
    event_loop_runner()(
        run_actor(
            child.spec, child.config, child.address, child.book, child.supervisor, child.parent
        )
    )


@dataclass
class _Member:
    role: str
    spec: str
    address: str
    process: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    task: asyncio.Task[Any] | None = None
    runtime: ActorRuntime | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    info: dict[str, Any] = field(default_factory=dict)
    last_beat: float = 0.0
    restarts: int = 0
    alive: bool = False
    pid: int = 0


class _SupervisorActor(Actor):
    role = "supervisor"
    inbox = (Ready, Heartbeat)

    def __init__(self, config: EngineConfig, launcher: Launcher) -> None:
        super().__init__(config)
        self.launcher = launcher

    @handles(Ready)
    async def on_ready(self, msg: Ready, env: Envelope) -> None:
        member = self.launcher.members.get(msg.role)
        if member is not None:
            member.info = dict(msg.info)
            member.pid = msg.pid
            member.last_beat = time.monotonic()
            member.alive = True
            member.ready.set()

    @handles(Heartbeat)
    async def on_heartbeat(self, msg: Heartbeat, env: Envelope) -> None:
        member = self.launcher.members.get(msg.role)
        if member is not None:
            member.last_beat = time.monotonic()


class Launcher:
    """Starts ``roles`` under supervision. Use ``async with Launcher(...)``.

    ``roles`` lists built-in role names, or maps role → ``"module:Class"`` for
    actors defined elsewhere (tests, plugins).
    """

    def __init__(
        self,
        config: EngineConfig,
        roles: list[str] | dict[str, str],
        *,
        placement: str = "process",
        addresses: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.placement = placement
        deploy = config.deploy
        transport = "inproc" if placement == "inproc" else deploy.transport
        self._own_run_dir = not deploy.run_dir
        self.run_dir = deploy.run_dir or tempfile.mkdtemp(prefix="actorlm-")
        given = dict(deploy.addresses)
        given.update(addresses or {})
        specs = roles if isinstance(roles, dict) else {r: r for r in roles}
        fresh = make_addresses([*specs, "supervisor"], transport, self.run_dir)
        self.book = {r: given.get(r, fresh[r]) for r in [*specs, "supervisor"]}
        self.members = {r: _Member(r, spec, self.book[r]) for r, spec in specs.items()}
        self.transport = ZmqTransport()
        self._clients: list[ActorRuntime] = []
        self._supervisor = ActorRuntime(
            _SupervisorActor(config, self),
            self.book["supervisor"],
            self.transport,
            RuntimeOptions(request_timeout_s=deploy.request_timeout_s, book=dict(self.book)),
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self._stopping = False

    # -- public ---------------------------------------------------------------
    async def __aenter__(self) -> Launcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def attach(self, runtime: ActorRuntime) -> None:
        """A local client runtime (gateway, Engine) that should hear PeerDown/PeerUp."""
        self._clients.append(runtime)
        runtime.book.update(self.book)

    def new_address(self, role: str) -> str:
        """A fresh address on this launcher's transport, for a client runtime."""
        transport = "inproc" if self.placement == "inproc" else self.config.deploy.transport
        return make_addresses([role], transport, self.run_dir)[role]

    def info(self, role: str) -> dict[str, Any]:
        return self.members[role].info

    async def start(self, timeout: float = 600.0) -> None:
        self._tasks.append(asyncio.create_task(self._supervisor.serve(), name="supervisor"))
        await self._supervisor.ready.wait()
        for member in self.members.values():
            self._spawn(member)
        try:
            await self._wait_ready(list(self.members.values()), timeout)
        except BaseException:
            await self.stop()
            raise
        self._tasks.append(asyncio.create_task(self._watch_heartbeats(), name="heartbeats"))

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask every actor to stop, wait, then terminate and kill stragglers; clean up files."""
        if self._stopping:
            return
        self._stopping = True
        for member in self.members.values():
            if member.alive or member.process is not None or member.task is not None:
                with contextlib.suppress(Exception):
                    await self._supervisor.send(member.role, Shutdown(reason="launcher stopping"))
        deadline = time.monotonic() + timeout
        for member in self.members.values():
            await self._reap(member, deadline)
        for task in self._tasks:
            task.cancel()
        self._supervisor.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients:
            # Attached clients share our ZMQ context, whose term() waits for every socket:
            # one still open (a gateway stopped while its actors were starting) hangs it.
            client.stop()
            client.close()
        self.transport.close()
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- spawning -------------------------------------------------------------
    def _spawn(self, member: _Member) -> None:
        member.ready = asyncio.Event()
        member.alive = False
        if self.placement == "inproc":
            runtime = ActorRuntime(
                build_actor(member.spec, self.config),
                member.address,
                self.transport,
                RuntimeOptions(
                    request_timeout_s=self.config.deploy.request_timeout_s,
                    heartbeat_s=self.config.deploy.heartbeat_s,
                    supervisor="supervisor",
                    book=dict(self.book),
                ),
            )
            member.runtime = runtime
            member.task = asyncio.create_task(runtime.serve(), name=member.role)
            member.task.add_done_callback(lambda t, m=member: self._on_exit(m, t))
            return
        child = ChildSpec(
            spec=member.spec,
            config=self.config,
            address=member.address,
            book=dict(self.book),
            supervisor="supervisor",
            parent=os.getpid(),
            sys_path=[p for p in sys.path if p],
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "actorlm.actors.runtime.child", member.role],
            stdin=subprocess.PIPE,
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.msgpack.encode(child))
        proc.stdin.close()
        member.process = proc
        loop = asyncio.get_running_loop()
        try:
            member.pidfd = os.pidfd_open(proc.pid)
            loop.add_reader(member.pidfd, self._on_pidfd, member, proc)
        except (AttributeError, OSError):  # no pidfd (old kernel, macOS): poll instead
            member.pidfd = -1
            loop.create_task(self._poll_exit(member, proc))

    def _on_pidfd(self, member: _Member, proc: subprocess.Popen[bytes]) -> None:
        self._close_pidfd(member)
        proc.wait()
        self._on_exit(member, f"process exited with code {proc.returncode}")

    def _close_pidfd(self, member: _Member) -> None:
        if member.pidfd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(member.pidfd)
            os.close(member.pidfd)
            member.pidfd = -1

    async def _poll_exit(self, member: _Member, proc: subprocess.Popen[bytes]) -> None:
        while proc.poll() is None:
            await asyncio.sleep(0.05)
        if member.process is proc:
            self._on_exit(member, f"process exited with code {proc.returncode}")

    def _on_exit(self, member: _Member, why: asyncio.Task[Any] | str) -> None:
        if isinstance(why, asyncio.Task):
            if why.cancelled():
                why = "cancelled"
            elif why.exception() is not None:
                why = f"crashed: {why.exception()!r}"
            else:
                why = "stopped"
        if self._stopping:
            return
        member.alive = False
        log.error("actor %s died: %s", member.role, why)
        asyncio.get_running_loop().create_task(self._handle_death(member, why))

    async def _handle_death(self, member: _Member, reason: str) -> None:
        await self._broadcast(PeerDown(role=member.role, reason=reason), exclude=member.role)
        allowed = self.config.deploy.restart.get(member.role, 0)
        if self._stopping or member.restarts >= allowed:
            return
        member.restarts += 1
        log.warning("restarting %s (%d/%d)", member.role, member.restarts, allowed)
        self._spawn(member)
        try:
            await self._wait_ready([member], 600.0)
        except StartupError:
            return
        await self._broadcast(PeerUp(role=member.role, address=member.address), exclude=member.role)

    async def _broadcast(self, msg: Message, exclude: str) -> None:
        for role, other in self.members.items():
            if role != exclude and other.alive:
                with contextlib.suppress(ActorError):
                    await self._supervisor.send(role, msg)
        for client in self._clients:
            # Local clients share this loop: deliver directly, no socket needed.
            if isinstance(msg, PeerDown):
                await client._peer_down(msg)
            elif isinstance(msg, PeerUp):
                await client._peer_up(msg)

    async def _wait_ready(self, members: list[_Member], timeout: float) -> None:
        async def one(member: _Member) -> None:
            while not member.ready.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(member.ready.wait(), 0.1)
                died = (member.process is not None and member.process.poll() is not None) or (
                    member.task is not None and member.task.done()
                )
                if died and not member.ready.is_set():
                    raise StartupError(f"actor {member.role} exited before it was ready")

        waiters = [asyncio.create_task(one(m), name=f"ready:{m.role}") for m in members]
        try:
            done, _ = await asyncio.wait(
                waiters, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION
            )
        finally:  # cancelled (Ctrl-C) or not: no waiter outlives this call unread
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        for w in done:
            if not w.cancelled() and w.exception() is not None:
                raise w.exception()  # type: ignore[misc]
        slow = [m.role for m in members if not m.ready.is_set()]
        if slow:
            raise StartupError(f"actors not ready after {timeout:g}s: {', '.join(slow)}")

    async def _watch_heartbeats(self) -> None:
        deploy = self.config.deploy
        limit = deploy.heartbeat_s * deploy.heartbeat_misses
        last = time.monotonic()
        while True:
            await asyncio.sleep(deploy.heartbeat_s)
            now = time.monotonic()
            if now - last > 2 * deploy.heartbeat_s:
                # This loop itself was starved (a busy client on the same loop): heartbeats
                # may sit unread in our inbox, so do not blame the actors for our lateness.
                for member in self.members.values():
                    member.last_beat = max(member.last_beat, now)
            last = now
            for member in self.members.values():
                if self._stopping:
                    return
                if member.alive and member.process is not None and now - member.last_beat > limit:
                    log.error(
                        "actor %s missed heartbeats for %.1fs; killing it", member.role, limit
                    )
                    member.process.kill()  # the sentinel reports the death

    async def _reap(self, member: _Member, deadline: float) -> None:
        if member.task is not None:
            try:
                await asyncio.wait_for(
                    asyncio.shield(member.task), max(0.1, deadline - time.monotonic())
                )
            except (TimeoutError, Exception):
                member.task.cancel()
                await asyncio.gather(member.task, return_exceptions=True)
        proc = member.process
        if proc is None:
            return
        self._close_pidfd(member)
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if proc.poll() is None:
            proc.terminate()
            await asyncio.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2)
        member.alive = False
