"""The launcher: starts a set of actors, in one process or one process each, waits
for every READY, restarts what dies, and shuts down cleanly.

Placement is configuration: ``placement="process"`` spawns one process per actor
(unix, ipc or tcp addresses), ``"inproc"`` runs them all on this event loop (inproc
addresses; tests and notebooks). The code of the actors is the same.

Liveness is the actors' own (``peers``: heartbeats between every pair, incarnation
ids); the launcher adds two things a peer cannot do. It sees a child process exit
within milliseconds (its pidfd) and tells everyone at once (``PeerDown`` with the
dead incarnation), and it kills a child whose heartbeats stopped (it hangs). Then,
by ``deploy.restart_policy``, it starts the role again, at most ``max_restarts``
times in ``restart_window_s``, and says ``PeerUp`` when the new incarnation is ready.
A role that served for ``STABLE_LIFE_S`` before it died restarts at once (a kill, an
OOM: every second of the wait is a second of 503s); one that keeps dying soon after
its start backs off (0.5 s, doubling up to 10 s) so a crash loop does not spin.
Stopping, the gateway (if it is a member) goes first, so it can drain the requests in
flight while the actors still serve them. A member may ask for that stop
(``StopDeployment``: the gateway's ``POST /drain``); ``on_stop_requested`` decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...config import EngineConfig
from ...messages.base import Message
from ...messages.control import (
    Ack,
    PeerDown,
    PeerUp,
    Ready,
    RestartMembers,
    Shutdown,
    StopDeployment,
)
from ...messages.envelope import Envelope
from .child import ACTOR_ROLES, ChildSpec, build_actor, run_actor
from .dispatch import Actor, ActorError, ActorRuntime, RuntimeOptions, handles
from .transport import ZmqTransport, free_port

__all__ = ["ACTOR_ROLES", "Launcher", "StartupError", "make_addresses", "run_actor"]

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 10.0
STABLE_LIFE_S = 10.0  # ready this long before a death: not a crash loop, no backoff
GATEWAY = "gateway"  # started first (it binds the HTTP port), stopped first (it drains)


class StartupError(RuntimeError):
    pass


def make_addresses(roles: list[str], transport: str, run_dir: str) -> dict[str, str]:
    """A fresh address per role for ``transport`` (inproc | unix | ipc | tcp on loopback)."""
    if transport == "inproc":
        tag = uuid.uuid4().hex[:8]
        return {r: f"inproc://actorlm-{tag}-{r}" for r in roles}
    if transport in ("unix", "ipc"):
        return {r: f"{transport}://{run_dir}/{r}.sock" for r in roles}
    if transport == "tcp":
        return {r: f"tcp://127.0.0.1:{free_port()}" for r in roles}
    raise ValueError(f"unknown transport {transport!r}; known: inproc, unix, ipc, tcp")


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
    alive: bool = False
    pid: int = 0
    incarnation: int = 0
    restarts: int = 0  # in all
    recent: list[float] = field(default_factory=list)  # restart times within the window
    ready_at: float = 0.0  # when the current incarnation said READY (0: not yet)
    quick_deaths: int = 0  # deaths in a row within STABLE_LIFE_S of a start
    planned: bool = False  # stopping for a restart asked for (RestartMembers): not a failure


class _SupervisorActor(Actor):
    role = "supervisor"

    def __init__(self, config: EngineConfig, launcher: Launcher) -> None:
        super().__init__(config)
        self.launcher = launcher

    @handles(Ready)
    async def on_ready(self, msg: Ready, env: Envelope) -> None:
        member = self.launcher.members.get(msg.role)
        if member is not None:
            member.info = dict(msg.info)
            member.pid, member.incarnation = msg.pid, msg.incarnation
            member.alive = True
            member.ready_at = time.monotonic()
            member.ready.set()
            if self.launcher.on_ready is not None:
                self.launcher.on_ready(msg.role)

    @handles(StopDeployment)
    async def on_stop_deployment(self, msg: StopDeployment, env: Envelope) -> None:
        stop = self.launcher.on_stop_requested
        if env.sender not in self.launcher.members:  # only the deployment's own members
            log.warning("dropped a stop request from %s: not a member", env.sender)
            return
        if stop is None:
            log.warning(
                "%s asked to stop the deployment (%s): no one here can", env.sender, msg.reason
            )
            return
        log.info("%s asked to stop the deployment: %s", env.sender, msg.reason)
        stop()

    @handles(RestartMembers)
    async def on_restart_members(self, msg: RestartMembers, env: Envelope) -> Ack:
        if env.sender not in self.launcher.members:
            raise PermissionError(f"{env.sender} is not a member of this deployment")
        unknown = [r for r in msg.roles if r not in self.launcher.members or r == env.sender]
        if unknown:
            return Ack(ok=False, detail=f"cannot restart {', '.join(unknown)}")
        log.info("%s asked to restart %s: %s", env.sender, ", ".join(msg.roles), msg.reason)
        try:
            await self.launcher.restart(msg.roles)
        except StartupError as exc:
            return Ack(ok=False, detail=str(exc))
        return Ack()


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
        if GATEWAY in specs:  # first to start, first to stop
            specs = {GATEWAY: specs[GATEWAY], **specs}
        fresh = make_addresses([*specs, "supervisor"], transport, self.run_dir)
        self.book = {r: given.get(r, fresh[r]) for r in [*specs, "supervisor"]}
        self.members = {r: _Member(r, spec, self.book[r]) for r, spec in specs.items()}
        self.transport = ZmqTransport.for_deploy(deploy)
        self.on_ready: Callable[[str], None] | None = None  # called with each role's READY
        # called when a member asks for the deployment to stop (StopDeployment)
        self.on_stop_requested: Callable[[], None] | None = None
        self._clients: list[ActorRuntime] = []
        self._supervisor = ActorRuntime(
            _SupervisorActor(config, self),
            self.book["supervisor"],
            self.transport,
            RuntimeOptions.from_deploy(deploy, book=dict(self.book)),
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

    async def restart(self, roles: list[str]) -> None:
        """Stop ``roles`` (each asked to shut down, killed if it has not within 5 s) and
        start them again at once, as after a death but planned: no backoff, not counted.
        Returns when every one is back and READY (StartupError if one is not)."""
        members = [self.members[r] for r in roles]
        old = {m.role: m.incarnation for m in members}
        for member in members:
            member.planned = True
            with contextlib.suppress(Exception):
                await self._supervisor.send(member.role, Shutdown(reason="restart asked for"))
        kill_at = time.monotonic() + 5.0
        deadline = kill_at + self.config.deploy.start_timeout_s
        for member in members:
            while member.incarnation == old[member.role] or not member.alive:
                now = time.monotonic()
                if now > deadline:
                    raise StartupError(f"{member.role} did not come back after its restart")
                if now > kill_at and member.incarnation == old[member.role] and member.alive:
                    self._kill(member)
                    kill_at = float("inf")
                await asyncio.sleep(0.05)

    async def start(self, timeout: float | None = None) -> None:
        self._tasks.append(asyncio.create_task(self._supervisor.serve(), name="supervisor"))
        await self._supervisor.ready.wait()
        for member in self.members.values():
            self._spawn(member)
        try:
            await self._wait_ready(
                list(self.members.values()), timeout or self.config.deploy.start_timeout_s
            )
        except BaseException:
            await self.stop()
            raise
        self._tasks.append(asyncio.create_task(self._watch_hung(), name="hung-watch"))

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop the gateway (it drains), then every actor; kill stragglers; clean up."""
        if self._stopping:
            return
        self._stopping = True
        self._supervisor.peers.timeout_s = float("inf")  # they go quiet now: not a death
        gateway = self.members.get(GATEWAY)
        if gateway is not None:
            drain = self.config.server.drain_timeout_s + 2.0
            await self._shutdown([gateway], time.monotonic() + drain)
        rest = [m for m in self.members.values() if m is not gateway]
        await self._shutdown(rest, time.monotonic() + timeout)
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

    async def _shutdown(self, members: list[_Member], deadline: float) -> None:
        for member in members:
            if member.alive or member.process is not None or member.task is not None:
                with contextlib.suppress(Exception):
                    await self._supervisor.send(member.role, Shutdown(reason="launcher stopping"))
        for member in members:
            await self._reap(member, deadline)

    # -- spawning -------------------------------------------------------------
    def _spawn(self, member: _Member) -> None:
        member.ready = asyncio.Event()
        member.alive = False
        member.ready_at = 0.0
        if self.placement == "inproc":
            options = RuntimeOptions.from_deploy(
                self.config.deploy, supervisor="supervisor", book=dict(self.book)
            )
            runtime = ActorRuntime(
                build_actor(member.spec, self.config), member.address, self.transport, options
            )
            member.runtime = runtime
            member.task = asyncio.create_task(runtime.serve(), name=member.role)
            member.task.add_done_callback(functools.partial(self._on_exit, member))
            return
        child = self._child_spec(member, os.getpid())
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

    def _child_spec(self, member: _Member, parent: int) -> ChildSpec:
        """What ``member``'s process reads on its stdin (``parent``: the process it
        watches, and stops without)."""
        return ChildSpec(
            spec=member.spec,
            config=self.config,
            address=member.address,
            book=dict(self.book),
            supervisor="supervisor",
            parent=parent,
            sys_path=[p for p in sys.path if p],
        )

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

    def _restart_delay(self, member: _Member) -> float | None:
        """Seconds to wait before restarting ``member``, or None: leave it down."""
        deploy = self.config.deploy
        if member.planned:
            member.planned = False
            return 0.0
        if deploy.restart_policy == "never":
            return None
        now = time.monotonic()
        member.recent = [t for t in member.recent if now - t < deploy.restart_window_s]
        if len(member.recent) >= deploy.max_restarts:
            log.error(
                "actor %s died %d times within %gs: leaving it down",
                member.role,
                len(member.recent),
                deploy.restart_window_s,
            )
            return None
        stable = member.ready_at > 0 and now - member.ready_at >= STABLE_LIFE_S
        member.quick_deaths = 0 if stable else member.quick_deaths + 1
        if member.quick_deaths == 0:
            return 0.0
        return min(MAX_BACKOFF_S, deploy.restart_backoff_s * 2 ** (member.quick_deaths - 1))

    async def _handle_death(self, member: _Member, reason: str) -> None:
        dead = PeerDown(role=member.role, reason=reason, incarnation=member.incarnation)
        await self._supervisor._peer_down(dead)  # nothing more is sent to it until it is back
        await self._broadcast(dead, exclude=member.role)
        planned = member.planned
        delay = self._restart_delay(member)
        if self._stopping or delay is None:
            return
        if not planned:
            member.recent.append(time.monotonic())
        member.restarts += 1
        log.warning("restarting %s in %.1fs (restart %d)", member.role, delay, member.restarts)
        await asyncio.sleep(delay)
        if self._stopping:
            return
        self._spawn(member)
        try:
            await self._wait_ready([member], self.config.deploy.start_timeout_s)
        except StartupError as exc:
            log.error("restarting %s failed: %s", member.role, exc)
            return
        up = PeerUp(role=member.role, address=member.address, incarnation=member.incarnation)
        await self._broadcast(up, exclude=member.role)

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

    async def _watch_hung(self) -> None:
        """Kill a child whose heartbeats stopped (the supervisor's peer table says it is
        down while its process lives): its exit then goes the usual way."""
        peers = self._supervisor.peers
        while not self._stopping:
            await asyncio.sleep(self.config.deploy.heartbeat_s)
            for member in self.members.values():
                peer = peers.peers.get(member.role)
                hung = (
                    member.alive
                    and peer is not None
                    and peer.incarnation == member.incarnation
                    and not peer.up
                )
                if hung and not self._stopping and self._kill(member):
                    log.error(
                        "actor %s sent nothing for %gs; killed it",
                        member.role,
                        self.config.deploy.peer_timeout_s,
                    )

    def _kill(self, member: _Member) -> bool:
        """Kill ``member``'s process (its exit then goes the usual way); False where
        there is none to kill (inproc)."""
        if member.process is None:
            return False
        member.process.kill()  # the pidfd reports the death
        return True

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
