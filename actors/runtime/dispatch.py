"""The actor runtime: an Actor's inbox, dispatch table, and its ways to talk.

:class:`ActorRuntime` runs one :class:`~actorlm.actors.runtime.actor.Actor` (declared
as that module shows): it binds the actor's inbox, hands each message to its
handler, and sends, requests and streams for it.

Liveness needs no supervisor (``peers``): the runtime heartbeats every peer in its
book, hears every message as a sign of life, and stamps what it sends with its
incarnation (a fresh id per start). A peer that falls silent, or that a supervisor
reports dead (``PeerDown``), or that shows up with a new incarnation, is down: every
pending call to it fails at once with :class:`ActorDied`, and the actor's
``on_peer_down`` runs before anything the new incarnation sent. Messages addressed
to an earlier incarnation of this actor, and messages from an incarnation known
dead, are dropped; a request among them is answered ``stale_incarnation``.

Every message in and out passes through the actor's interceptor chain; a
message that fails to decode, or is rejected, gets its sender an error reply
and the actor goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from ...config import DeployConfig
from ...extensions.interceptors import DROP, InterceptorChain, Reject
from ...messages.base import Message
from ...messages.control import (
    Ack,
    ErrorReply,
    GetStats,
    Heartbeat,
    PeerDown,
    PeerUp,
    Ping,
    Pong,
    Ready,
    Shutdown,
    Stats,
)
from ...messages.envelope import Codec, DecodeError, Envelope, Kind
from ...messages.errors import CallErrorCode
from ..replicas import base_role
from .actor import Actor, handles
from .calls import ActorDied, ActorError, Calls, RemoteError, RequestTimeout, error_from_reply
from .keys import key_name
from .peers import Change, ChangeKind, PeerTable
from .transport import Inbox, Outbox, Transport

__all__ = [
    "RESTARTED",
    "RUNTIME_MESSAGES",
    "Actor",
    "ActorDied",
    "ActorError",
    "ActorRuntime",
    "RemoteError",
    "RequestTimeout",
    "RuntimeOptions",
    "handles",
]

log = logging.getLogger(__name__)
Builtin = Callable[[Envelope, Any], Awaitable[None]]
Inbound = tuple[Envelope, Message] | DecodeError | Change  # what waits in the slow lane
# Messages only the supervisor may send: from anyone else they are dropped and logged.
_SUPERVISOR_ONLY = (PeerDown, PeerUp, Shutdown)
# Messages the runtime answers itself, before any handler: an actor's own never runs.
RUNTIME_MESSAGES: tuple[type[Message], ...] = (*_SUPERVISOR_ONLY, Heartbeat)


# The ``reason`` an actor's on_peer_down gets when the peer came back as a new
# incarnation: its state is certainly gone (a silent peer may only be slow).
RESTARTED = "restarted"


def new_incarnation() -> int:
    return random.getrandbits(62) | 1  # never 0, which means "unknown"


@dataclass
class RuntimeOptions:
    request_timeout_s: float = 60.0
    heartbeat_s: float = 0.0  # heartbeats to every peer in the book; 0: none, and no expiry
    peer_timeout_s: float = 3.0  # a peer silent this long is down
    max_message_bytes: int = 256 * 1024 * 1024
    supervisor: str = ""  # role that READY goes to, and control messages come from ("" = none)
    controller: str = ""  # whose control messages are obeyed, if not the supervisor's
    bind: str = ""  # address to bind when it differs from the one peers use (tcp://0.0.0.0:N)
    interceptors: InterceptorChain | None = None
    book: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_deploy(cls, deploy: DeployConfig, **overrides: Any) -> RuntimeOptions:
        """The options of an actor (or client) in a deployment configured by ``deploy``."""
        values: dict[str, Any] = {
            "request_timeout_s": deploy.request_timeout_s,
            "heartbeat_s": deploy.heartbeat_s,
            "peer_timeout_s": deploy.peer_timeout_s,
            "max_message_bytes": deploy.max_message_bytes,
        }
        values.update(overrides)
        return cls(**values)


class ActorRuntime:
    """Runs one actor: binds its inbox at ``address``, dispatches, sends."""

    def __init__(
        self,
        actor: Actor,
        address: str,
        transport: Transport,
        options: RuntimeOptions | None = None,
    ) -> None:
        self.actor = actor
        self.role = actor.role
        self.address = address
        self.transport = transport
        self.options = options or RuntimeOptions()
        self.book: dict[str, str] = dict(self.options.book)
        self.book[self.role] = address
        self.codec = Codec(self.options.max_message_bytes)
        chain = self.options.interceptors
        # A replica's member (scheduler.1) runs its role's interceptors.
        self.interceptors = chain if chain is not None else InterceptorChain(base_role(self.role))
        # A chain's members are fixed when it is built: with none, skip it outright.
        self._intercepting = bool(self.interceptors)
        self.incarnation = new_incarnation()
        self.peers = PeerTable(self.options.peer_timeout_s)
        self.ready = asyncio.Event()
        self._ids = itertools.count(1)
        self.calls = Calls()
        self._builtins = self._builtin_table()
        self._outboxes: dict[str, Outbox] = {}
        self._inbox: Inbox | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()
        self._graceful = False
        self._backlog: list[tuple[Envelope, Message]] = []
        self._slow: deque[Inbound] = deque()  # the slow lane (see "receiving")
        self._slow_ready = asyncio.Event()
        actor.runtime = self

    # -- lifecycle -----------------------------------------------------------
    async def serve(self) -> None:
        """Bind, start the actor, announce READY, and dispatch until stopped."""
        self._inbox = self.transport.bind(self.options.bind or self.address, self.role)
        self._inbox.listen(self._on_frames)
        recv = asyncio.create_task(self._slow_loop(), name=f"{self.role}-recv")
        watch: asyncio.Task[Any] | None = None
        try:
            start = asyncio.create_task(self.actor.on_start())
            stopping = asyncio.create_task(self._stopping.wait())
            await asyncio.wait({start, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():  # told to stop while still starting (a slow model load)
                start.cancel()
                await asyncio.gather(start, return_exceptions=True)
                return
            stopping.cancel()
            start.result()
            self.ready.set()
            backlog, self._backlog = self._backlog, []
            for env, msg in backlog:  # what arrived while on_start ran, in arrival order
                await self._dispatch_message(env, msg)
            if self.options.supervisor:
                info = self.actor.ready_info()
                ready = Ready(
                    role=self.role,
                    pid=os.getpid(),
                    address=self.address,
                    info=info,
                    incarnation=self.incarnation,
                )
                await self.send(self.options.supervisor, ready)
            if self.options.heartbeat_s > 0:
                watch = asyncio.create_task(self._liveness_loop(), name=f"{self.role}-liveness")
            stop = asyncio.create_task(self._stopping.wait())
            await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
            if recv.done() and not self._stopping.is_set():
                recv.result()  # the receive loop died: raise its error
        finally:
            if self._inbox is not None:  # nothing new starts while we wind down
                self._inbox.close()
                self._inbox = None
            for task in (recv, watch, *self._tasks):
                if task is not None:
                    task.cancel()
            await asyncio.gather(recv, *self._tasks, return_exceptions=True)
            self.calls.fail(ActorDied(f"{self.role} is stopping"))
            try:
                await self.actor.on_stop()
            except Exception:
                log.exception("%s: on_stop failed", self.role)
            self.close()

    def stop(self) -> None:
        self._stopping.set()

    def stop_gracefully(self) -> None:
        """Stop after the actor's ``before_stop`` (a drain) has run, while it can still
        talk to its peers."""
        if not self._stopping.is_set() and not self._graceful:
            self._graceful = True
            self.spawn(self._stop_after_drain(), name=f"{self.role}-drain")

    async def _stop_after_drain(self) -> None:
        try:
            await self.actor.before_stop()
        except Exception:
            log.exception("%s: before_stop failed", self.role)
        self.stop()

    def close(self) -> None:
        for box in self._outboxes.values():
            box.close()
        self._outboxes.clear()
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None

    def spawn(self, coro: Awaitable[Any], name: str | None = None) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        if name:
            task.set_name(name)
        return self._track(task)

    def _track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "%s: background task %s failed",
                self.role,
                task.get_name(),
                exc_info=task.exception(),
            )

    # -- liveness ---------------------------------------------------------------
    @property
    def down(self) -> set[str]:
        """Peers heard from once that are not alive now."""
        return self.peers.down

    async def _liveness_loop(self) -> None:
        """Heartbeat every peer in the book; peers silent too long are down."""
        beat = Heartbeat(role=self.role, pid=os.getpid())
        period = self.options.heartbeat_s
        last = time.monotonic()
        while True:
            for role in [r for r in self.book if r != self.role]:
                with contextlib.suppress(ActorError):
                    await self._emit(role, beat, Kind.SEND, next(self._ids))
            await asyncio.sleep(period)
            now = time.monotonic()
            if now - last > 2 * period:
                self.peers.forgive(now)  # we were late, not them
            last = now
            for change in self.peers.expire(now):
                self._peer_changed(change)

    def peer_incarnation(self, role: str) -> int:
        return self.peers.incarnation(role)

    def _peer_changed(self, change: Change) -> None:
        """Fail what is pending on a peer that went down or restarted (now), then run the
        actor's hooks in the slow lane, before anything the new incarnation sent."""
        if change.kind is not ChangeKind.UP:
            self.calls.fail(ActorDied(f"actor {change.role!r} died: {change.reason}"), change.role)
            address = self.book.get(change.role)
            box = self._outboxes.pop(address, None) if address else None
            if box is not None:
                box.close()  # what is queued for the dead one must not reach its successor
            if change.role not in self.options.book:
                # A peer that introduced itself (a client): forgotten once gone, or every
                # client that ever came would keep a socket and a heartbeat here for good.
                # Its next message (its reply address) introduces it again.
                self.book.pop(change.role, None)
            log.warning(
                "%s: peer %s %s (%s)", self.role, change.role, change.kind.value, change.reason
            )
        else:
            log.debug("%s: peer %s is up", self.role, change.role)
        self._slow.append(change)
        self._slow_ready.set()

    async def _on_peer_change(self, change: Change) -> None:
        if change.kind is not ChangeKind.UP:
            reason = change.reason if change.kind is ChangeKind.DOWN else RESTARTED
            await self._guard(self.actor.on_peer_down(change.role, reason), None)
        if change.kind is not ChangeKind.DOWN:
            await self._guard(self.actor.on_peer_up(change.role), None)

    # -- sending -------------------------------------------------------------
    def _outbox(self, to: str) -> Outbox:
        address = self.book.get(to)
        if address is None:
            raise ActorError(
                f"{self.role}: no address for actor {to!r}", code=CallErrorCode.UNKNOWN_ACTOR
            )
        box = self._outboxes.get(address)
        if box is None:
            box = self._outboxes[address] = self.transport.connect(address, to, self.role)
        return box

    async def _emit(
        self,
        to: str,
        msg: Message,
        kind: Kind,
        msg_id: int,
        reply_to: int = 0,
        to_incarnation: int | None = None,
    ) -> bool:
        if self._intercepting:
            out = await self.interceptors.run(msg, "out", to, msg.TAG)
            if out is DROP:
                return False
            msg = out
        target = self.peers.incarnation(to) if to_incarnation is None else to_incarnation
        env = Envelope(
            msg.TAG,
            msg_id,
            self.role,
            kind,
            reply_to,
            self.address,
            self.incarnation,
            target,
        )
        try:
            await self._outbox(to).send(self.codec.encode(env, msg))
        except ConnectionError as exc:
            raise ActorDied(f"actor {to!r} cannot be reached: {exc}") from None
        return True

    async def send(self, to: str, msg: Message) -> int:
        """Fire and forget; returns the message id (errors come to ``on_error``)."""
        msg_id = next(self._ids)
        await self._emit(to, msg, Kind.SEND, msg_id)
        return msg_id

    def _timeout(self, timeout: float | None) -> float:
        return self.options.request_timeout_s if timeout is None else timeout

    async def request(self, to: str, msg: Message, timeout: float | None = None) -> Message:
        if to in self.down:
            raise ActorDied(f"actor {to!r} is down")
        msg_id = next(self._ids)
        future = self.calls.request(msg_id, to, msg.TAG, self._timeout(timeout))
        try:
            await self._emit(to, msg, Kind.REQUEST, msg_id)
            return await future
        finally:
            self.calls.finish(msg_id)

    async def stream(
        self, to: str, msg: Message, timeout: float | None = None
    ) -> AsyncIterator[Message]:
        """Items of a streamed reply; ``timeout`` bounds the wait for each item."""
        if to in self.down:
            raise ActorDied(f"actor {to!r} is down")
        msg_id = next(self._ids)
        queue = self.calls.stream(msg_id, to)
        try:
            await self._emit(to, msg, Kind.REQUEST, msg_id)
            while True:
                try:
                    kind, item = await asyncio.wait_for(queue.get(), self._timeout(timeout))
                except TimeoutError:
                    raise RequestTimeout(f"{to!r} stream for {msg.TAG!r} stalled") from None
                if kind == Kind.END:
                    return
                if kind == Kind.ERROR:
                    assert isinstance(item, ErrorReply)
                    raise error_from_reply(item)
                yield item
        finally:
            self.calls.finish(msg_id)

    async def _reply(self, env: Envelope, msg: Message, kind: Kind) -> None:
        try:
            await self._emit(env.sender, msg, kind, next(self._ids), env.id, env.incarnation)
        except ActorError as exc:
            log.warning("%s: cannot reply to %s: %s", self.role, env.sender, exc)

    async def _reply_error(
        self, env: Envelope, code: CallErrorCode, message: str, status: int
    ) -> None:
        await self._reply(env, ErrorReply(code=code, message=message, status=status), Kind.ERROR)

    # -- receiving -----------------------------------------------------------
    # Two lanes, one order. The fast lane runs inside the inbox's loop callback
    # and finishes what needs no await: a reply handed to its call, a message
    # handed to a new handler task. The rest (interceptors, built-in messages,
    # bad frames, anything before READY) goes to the slow lane, a task that
    # awaits each in turn; while it holds anything, later arrivals queue behind.
    def _on_frames(self, frames: list[bytes], identity: str = "") -> None:
        item: Inbound
        try:
            item = self.codec.decode(frames)
        except DecodeError as exc:
            # Without its traceback: that holds this frame, whose `item` holds the
            # error, a cycle keeping `frames` (up to the size limit and past it) alive
            # until the cyclic collector happens to run.
            item = exc.with_traceback(None)
        else:
            env = item[0]
            if identity and key_name(env.sender) != identity:
                log.warning(
                    "%s: dropped %s claiming to come from %s: its key is %s's",
                    self.role,
                    env.tag,
                    env.sender,
                    identity,
                )
                return
            self._learn(env)
            if self._stale(env, item[1]):
                return
            change = self.peers.heard(env.sender, env.incarnation, time.monotonic())
            if change is not None:
                self._peer_changed(change)
            if not self._slow and self._handle_now(*item):
                return
        self._slow.append(item)
        self._slow_ready.set()

    def _stale(self, env: Envelope, msg: Message) -> bool:
        """Drop what an earlier incarnation of this actor was sent, and what a dead
        incarnation of the sender still had in flight (a request gets an error)."""
        if env.to_incarnation and env.to_incarnation != self.incarnation:
            why = f"addressed to an earlier incarnation of {self.role}"
        elif self.peers.is_stale(env.sender, env.incarnation):
            why = f"from a dead incarnation of {env.sender}"
        else:
            return False
        log.warning("%s: dropped %s from %s: %s", self.role, env.tag, env.sender, why)
        if env.kind == Kind.REQUEST and self._learn(env):
            reply = ErrorReply(code=CallErrorCode.STALE_INCARNATION, message=why, status=503)
            self.spawn(self._reply(env, reply, Kind.ERROR))
        return True

    def _handle_now(self, env: Envelope, msg: Message) -> bool:
        """Finish ``msg`` here if that needs no await; False leaves it to the slow lane."""
        if self._intercepting:
            return False
        if env.kind >= Kind.REPLY:
            if env.reply_to in self.calls:
                self.calls.deliver(env.reply_to, env.kind, msg)
                return True
            return env.kind != Kind.ERROR  # a late reply is dropped, a late error reported
        if type(msg) in self._builtins or not self.ready.is_set():
            return False
        name = self.actor.handlers.get(type(msg))
        if name is None:
            return False
        self._start_handler(env, msg, name)
        return True

    async def _slow_loop(self) -> None:
        slow = self._slow
        while True:
            if not slow:
                self._slow_ready.clear()
                await self._slow_ready.wait()
                continue
            item = slow[0]  # it stays queued while handled: later arrivals wait behind it
            try:
                if isinstance(item, Change):
                    await self._on_peer_change(item)
                elif isinstance(item, DecodeError):
                    await self._on_bad_frames(item)
                elif item[0].kind >= Kind.REPLY:
                    await self._on_reply(*item)
                else:
                    await self._on_message(*item)
            finally:
                slow.popleft()

    async def _on_bad_frames(self, exc: DecodeError) -> None:
        log.warning("%s: rejected a message: %s", self.role, exc)
        bad = exc.envelope
        if bad is not None and bad.kind in (Kind.SEND, Kind.REQUEST) and self._learn(bad):
            await self._reply_error(bad, CallErrorCode.BAD_MESSAGE, str(exc), 400)

    def _learn(self, env: Envelope) -> bool:
        """Remember where ``env.sender`` lives so replies and later sends reach it."""
        if env.reply_addr:
            self.book.setdefault(env.sender, env.reply_addr)
        return env.sender in self.book

    async def _intercept_in(self, env: Envelope, msg: Message) -> Message | None:
        try:
            out = await self.interceptors.run(msg, "in", env.sender, env.tag)
        except Reject as exc:
            if env.kind in (Kind.SEND, Kind.REQUEST):
                await self._reply_error(env, CallErrorCode.REJECTED, exc.reason, exc.status)
            else:
                rejected = ErrorReply(code=CallErrorCode.REJECTED, message=exc.reason)
                self.calls.deliver(env.reply_to, Kind.ERROR, rejected)
            return None
        return None if out is DROP else out

    async def _on_reply(self, env: Envelope, msg: Message) -> None:
        if env.reply_to not in self.calls:
            if env.kind == Kind.ERROR and isinstance(msg, ErrorReply):
                await self._guard(self.actor.on_error(env, msg), msg)
            return  # a late reply to a request that timed out
        if self._intercepting:
            intercepted = await self._intercept_in(env, msg)
            if intercepted is None:
                return
            msg = intercepted
        self.calls.deliver(env.reply_to, env.kind, msg)

    async def _on_message(self, env: Envelope, msg: Message) -> None:
        controller = self.options.controller or self.options.supervisor
        if isinstance(msg, _SUPERVISOR_ONLY) and env.sender != controller:
            log.warning(
                "%s: dropped %s from %s: control messages are obeyed only from the supervisor",
                self.role,
                env.tag,
                env.sender,
            )
            return
        if self._intercepting:
            intercepted = await self._intercept_in(env, msg)
            if intercepted is None:
                return
            msg = intercepted
        if not self.ready.is_set() and not isinstance(msg, (PeerDown, PeerUp, Shutdown)):
            # Not started yet: handlers would see a half-built actor. Even Ping waits,
            # so a peer that pings until it gets an answer knows we are ready.
            self._backlog.append((env, msg))
            return
        await self._dispatch_message(env, msg)

    async def _dispatch_message(self, env: Envelope, msg: Message) -> None:
        builtin = self._builtins.get(type(msg))
        if builtin is not None:
            await builtin(env, msg)
            return
        name = self.actor.handlers.get(type(msg))
        if name is None:
            await self._reply_error(
                env, CallErrorCode.NO_HANDLER, f"{self.role} does not accept {env.tag!r}", 400
            )
            return
        self._start_handler(env, msg, name)

    def _start_handler(self, env: Envelope, msg: Message, name: str) -> None:
        # A task per message, so a handler that awaits another actor never holds up
        # receiving. No done callback, which would cost the loop another round per
        # message: the task leaves ``_tasks`` itself when it ends (see _dispatch).
        coro = self._dispatch(env, msg, getattr(self.actor, name))
        self._tasks.add(asyncio.get_running_loop().create_task(coro))

    def _builtin_table(self) -> dict[type[Message], Builtin]:
        """Messages every actor understands, answered by the runtime itself
        (Ping and GetStats only where the actor has no handler of its own)."""
        table: dict[type[Message], Builtin] = {  # RUNTIME_MESSAGES, and Ping, GetStats
            PeerDown: lambda env, msg: self._peer_down(msg),
            PeerUp: lambda env, msg: self._peer_up(msg),
            Shutdown: self._shutdown,
            Heartbeat: self._ignore,  # counted as a sign of life on arrival; nothing more
        }
        if Ping not in self.actor.handlers:
            table[Ping] = self._pong
        if GetStats not in self.actor.handlers:
            table[GetStats] = self._stats
        return table

    async def _ignore(self, env: Envelope, msg: Message) -> None:
        pass

    async def _pong(self, env: Envelope, msg: Ping) -> None:
        await self._reply(env, Pong(payload=msg.payload), Kind.REPLY)

    async def _stats(self, env: Envelope, msg: Message) -> None:
        await self._reply(env, Stats(role=self.role, values=self.actor.stats()), Kind.REPLY)

    async def _shutdown(self, env: Envelope, msg: Message) -> None:
        self.stop_gracefully()
        if env.kind == Kind.REQUEST:
            await self._reply(env, Ack(), Kind.REPLY)

    async def _peer_down(self, msg: PeerDown) -> None:
        """The supervisor saw ``msg.role`` die: down now, without waiting for silence."""
        change = self.peers.mark_down(msg.role, msg.reason, msg.incarnation)
        if change is not None:
            self._peer_changed(change)

    async def _peer_up(self, msg: PeerUp) -> None:
        """The supervisor restarted ``msg.role`` at ``msg.address``."""
        old = self.book.get(msg.role)
        self.book[msg.role] = msg.address
        if old and old != msg.address and old in self._outboxes:
            self._outboxes.pop(old).close()
        change = self.peers.heard(msg.role, msg.incarnation, time.monotonic())
        if change is not None:
            self._peer_changed(change)

    async def _guard(self, coro: Awaitable[Any], msg: Message | None) -> None:
        try:
            await coro
        except Exception as exc:
            log.exception("%s: hook failed", self.role)
            try:
                await self.actor.on_failure(exc, msg)
            except Exception:
                log.exception("%s: on_failure failed", self.role)

    async def _dispatch(self, env: Envelope, msg: Message, handler: Callable[..., Any]) -> None:
        is_request = env.kind == Kind.REQUEST
        try:
            result = handler(msg, env)
            if inspect.isasyncgen(result):
                async for item in result:
                    await self._reply(env, cast(Message, item), Kind.STREAM)
                await self._reply(env, Ack(), Kind.END)
                return
            if inspect.isawaitable(result):
                result = await result
            if is_request:
                await self._reply(env, result if result is not None else Ack(), Kind.REPLY)
        except asyncio.CancelledError:
            raise
        except Reject as exc:
            await self._reply_error(env, CallErrorCode.REJECTED, exc.reason, exc.status)
        except ActorError as exc:
            await self._reply_error(env, exc.code, str(exc), exc.status)
        except Exception as exc:
            log.exception("%s: handler for %s failed", self.role, env.tag)
            await self._reply_error(
                env,
                CallErrorCode.HANDLER_ERROR,
                f"{self.role}: {type(exc).__name__}: {exc}",
                500,
            )
            await self._guard(self.actor.on_failure(exc, msg), msg)
        finally:
            self._tasks.discard(asyncio.current_task())
