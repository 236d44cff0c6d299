"""The actor runtime: an Actor's inbox, dispatch table, and its ways to talk.

An actor declares the messages it accepts and a handler for each::

    class Echo(Actor):
        role = "echo"
        inbox = (Ping,)

        @handles(Ping)
        async def on_ping(self, msg: Ping, env: Envelope) -> Pong:
            return Pong(payload=msg.payload)

A handler returns a reply (sent when the message was a request), ``None``, or is
an async generator whose items stream back to the requester. Callers use
``send`` (fire and forget), ``request`` (one reply, with a timeout) and
``stream`` (many replies). When a peer dies (the supervisor says ``PeerDown``),
every pending call to it fails at once with :class:`ActorDied`.

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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from ..config import EngineConfig
from ..extensions.interceptors import DROP, InterceptorChain, Reject
from ..messages.base import Message
from ..messages.control import (
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
from ..messages.envelope import Codec, DecodeError, Envelope, Kind
from .transport import Inbox, Outbox, Transport

__all__ = [
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
T = TypeVar("T")
Handler = Callable[[Any, Message, Envelope], Any]


class ActorError(Exception):
    """A failed call to another actor. ``code`` is stable; ``status`` HTTP-like."""

    code = "actor_error"
    status = 500

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class RequestTimeout(ActorError):
    code, status = "timeout", 504


class ActorDied(ActorError):
    code, status = "actor_died", 503


class RemoteError(ActorError):
    """The peer answered with an ErrorReply."""


def _error_from_reply(reply: ErrorReply) -> ActorError:
    cls = ActorDied if reply.code == ActorDied.code else RemoteError
    return cls(reply.message, code=reply.code, status=reply.status)


def handles(*types: type[Message]) -> Callable[[T], T]:
    """Mark an actor method as the handler of ``types``."""

    def decorator(fn: T) -> T:
        fn._actorlm_handles = types  # type: ignore[attr-defined]
        return fn

    return decorator


class Actor:
    """Base class: subclasses set ``role`` and ``inbox`` and decorate handlers."""

    role: ClassVar[str] = ""
    inbox: ClassVar[tuple[type[Message], ...]] = ()
    handlers: ClassVar[dict[type[Message], str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[type[Message], str] = {}
        for klass in reversed(cls.__mro__):
            for name, fn in vars(klass).items():
                for typ in getattr(fn, "_actorlm_handles", ()):
                    table[typ] = name
        cls.handlers = table

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runtime: ActorRuntime  # set when the runtime adopts the actor

    # -- lifecycle (override) -------------------------------------------------
    async def on_start(self) -> None:
        """Runs before READY is announced: load models, connect to peers."""

    async def on_stop(self) -> None:
        """Runs once on shutdown, after the inbox is closed."""

    async def on_failure(self, exc: BaseException, msg: Message | None) -> None:
        """A handler raised ``exc`` while handling ``msg`` (the actor keeps running)."""

    async def on_peer_down(self, role: str, reason: str) -> None:
        """The supervisor reported ``role`` dead; pending calls to it already failed."""

    async def on_peer_up(self, role: str) -> None:
        """``role`` is back (restarted)."""

    async def on_error(self, env: Envelope, error: ErrorReply) -> None:
        """A message this actor *sent* (not requested) was rejected or failed at the peer."""

    def ready_info(self) -> dict[str, Any]:
        """Facts announced with READY (e.g. the worker's model info)."""
        return {}

    def stats(self) -> dict[str, Any]:
        return {}

    # -- talking (delegates to the runtime) -----------------------------------
    async def send(self, to: str, msg: Message) -> int:
        return await self.runtime.send(to, msg)

    async def request(self, to: str, msg: Message, timeout: float | None = None) -> Message:
        return await self.runtime.request(to, msg, timeout)

    def stream(self, to: str, msg: Message, timeout: float | None = None) -> AsyncIterator[Message]:
        return self.runtime.stream(to, msg, timeout)

    def spawn(self, coro: Awaitable[Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` in the actor's task group (cancelled on stop)."""
        return self.runtime.spawn(coro, name)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking work (a forward pass, a long tokenization) off the event loop."""
        return await asyncio.to_thread(fn, *args)


@dataclass
class _Pending:
    to: str
    future: asyncio.Future[Message] | None = None
    queue: asyncio.Queue[tuple[int, Message]] | None = None


@dataclass
class RuntimeOptions:
    request_timeout_s: float = 60.0
    heartbeat_s: float = 0.5
    max_message_bytes: int = 256 * 1024 * 1024
    supervisor: str = ""  # role to send Ready/Heartbeat to ("" = none)
    bind: str = ""  # address to bind when it differs from the one peers use (tcp://0.0.0.0:N)
    interceptors: InterceptorChain | None = None
    book: dict[str, str] = field(default_factory=dict)


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
        self.interceptors = chain if chain is not None else InterceptorChain(self.role)
        self.down: set[str] = set()
        self.ready = asyncio.Event()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._outboxes: dict[str, Outbox] = {}
        self._inbox: Inbox | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()
        self._backlog: list[tuple[Envelope, Message]] = []
        actor.runtime = self

    # -- lifecycle -----------------------------------------------------------
    async def serve(self) -> None:
        """Bind, start the actor, announce READY, and dispatch until stopped."""
        self._inbox = self.transport.bind(self.options.bind or self.address)
        recv = asyncio.create_task(self._recv_loop(), name=f"{self.role}-recv")
        beat: asyncio.Task[Any] | None = None
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
                await self.send(
                    self.options.supervisor,
                    Ready(role=self.role, pid=os.getpid(), address=self.address, info=info),
                )
                beat = asyncio.create_task(self._heartbeat_loop(), name=f"{self.role}-heartbeat")
            stop = asyncio.create_task(self._stopping.wait())
            await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
            if recv.done() and not self._stopping.is_set():
                recv.result()  # the receive loop died: raise its error
        finally:
            for task in (recv, beat, *self._tasks):
                if task is not None:
                    task.cancel()
            await asyncio.gather(recv, *self._tasks, return_exceptions=True)
            self._fail_pending(lambda p: True, ActorDied(f"{self.role} is stopping"))
            with contextlib.suppress(Exception):
                await self.actor.on_stop()
            self.close()

    def stop(self) -> None:
        self._stopping.set()

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

    async def _heartbeat_loop(self) -> None:
        beat = Heartbeat(role=self.role, pid=os.getpid())
        while True:
            await asyncio.sleep(self.options.heartbeat_s)
            with contextlib.suppress(ActorError):
                await self.send(self.options.supervisor, beat)

    # -- sending -------------------------------------------------------------
    def _outbox(self, to: str) -> Outbox:
        address = self.book.get(to)
        if address is None:
            raise ActorError(f"{self.role}: no address for actor {to!r}", code="unknown_actor")
        box = self._outboxes.get(address)
        if box is None:
            box = self._outboxes[address] = self.transport.connect(address)
        return box

    async def _emit(
        self, to: str, msg: Message, kind: Kind, msg_id: int, reply_to: int = 0
    ) -> bool:
        if self.interceptors:
            out = await self.interceptors.run(msg, "out", to, msg.TAG)
            if out is DROP:
                return False
            msg = out
        env = Envelope(msg.TAG, msg_id, self.role, kind, reply_to, self.address)
        await self._outbox(to).send(self.codec.encode(env, msg))
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
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Message] = loop.create_future()
        self._pending[msg_id] = _Pending(to, future=future)
        limit = self._timeout(timeout)
        # A timer on the future, not asyncio.wait_for: wait_for costs a task
        # switch and callbacks on every request; the timer is one heap entry.
        timer = loop.call_later(limit, _expire, future, to, msg.TAG, limit)
        try:
            await self._emit(to, msg, Kind.REQUEST, msg_id)
            return await future
        finally:
            timer.cancel()
            self._pending.pop(msg_id, None)

    async def stream(
        self, to: str, msg: Message, timeout: float | None = None
    ) -> AsyncIterator[Message]:
        """Items of a streamed reply; ``timeout`` bounds the wait for each item."""
        if to in self.down:
            raise ActorDied(f"actor {to!r} is down")
        msg_id = next(self._ids)
        queue: asyncio.Queue[tuple[int, Message]] = asyncio.Queue()
        self._pending[msg_id] = _Pending(to, queue=queue)
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
                    raise _error_from_reply(item)
                yield item
        finally:
            self._pending.pop(msg_id, None)

    async def _reply(self, env: Envelope, msg: Message, kind: Kind) -> None:
        try:
            await self._emit(env.sender, msg, kind, next(self._ids), env.id)
        except ActorError as exc:
            log.warning("%s: cannot reply to %s: %s", self.role, env.sender, exc)

    async def _reply_error(self, env: Envelope, code: str, message: str, status: int) -> None:
        await self._reply(env, ErrorReply(code=code, message=message, status=status), Kind.ERROR)

    # -- receiving -----------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self._inbox is not None
        while True:
            frames = await self._inbox.recv()
            try:
                env, msg = self.codec.decode(frames)
            except DecodeError as exc:
                log.warning("%s: rejected a message: %s", self.role, exc)
                bad = exc.envelope
                if bad is not None and bad.kind in (Kind.SEND, Kind.REQUEST) and self._learn(bad):
                    await self._reply_error(bad, "bad_message", str(exc), 400)
                continue
            self._learn(env)
            if env.kind >= Kind.REPLY:
                await self._on_reply(env, msg)
            else:
                await self._on_message(env, msg)

    def _learn(self, env: Envelope) -> bool:
        """Remember where ``env.sender`` lives so replies and later sends reach it."""
        if env.reply_addr:
            self.book.setdefault(env.sender, env.reply_addr)
        return env.sender in self.book

    async def _intercept_in(self, env: Envelope, msg: Message) -> Message | None:
        if not self.interceptors:
            return msg
        try:
            out = await self.interceptors.run(msg, "in", env.sender, env.tag)
        except Reject as exc:
            if env.kind in (Kind.SEND, Kind.REQUEST):
                await self._reply_error(env, "rejected", exc.reason, exc.status)
            elif env.reply_to in self._pending:
                self._deliver(
                    env.reply_to, Kind.ERROR, ErrorReply(code="rejected", message=exc.reason)
                )
            return None
        return None if out is DROP else out

    async def _on_reply(self, env: Envelope, msg: Message) -> None:
        pending = self._pending.get(env.reply_to)
        if pending is None:
            if env.kind == Kind.ERROR and isinstance(msg, ErrorReply):
                await self._guard(self.actor.on_error(env, msg), msg)
            return  # a late reply to a request that timed out
        intercepted = await self._intercept_in(env, msg)
        if intercepted is not None:
            self._deliver(env.reply_to, Kind(env.kind), intercepted)

    def _deliver(self, msg_id: int, kind: Kind, msg: Message) -> None:
        pending = self._pending.get(msg_id)
        if pending is None:
            return
        if pending.queue is not None:
            pending.queue.put_nowait((kind, msg))
        elif pending.future is not None and not pending.future.done():
            if kind == Kind.ERROR and isinstance(msg, ErrorReply):
                pending.future.set_exception(_error_from_reply(msg))
            else:
                pending.future.set_result(msg)

    def _fail_pending(self, match: Callable[[_Pending], bool], exc: ActorError) -> None:
        reply = ErrorReply(code=exc.code, message=str(exc), status=exc.status)
        for msg_id, pending in list(self._pending.items()):
            if match(pending):
                self._deliver(msg_id, Kind.ERROR, reply)

    async def _on_message(self, env: Envelope, msg: Message) -> None:
        intercepted = await self._intercept_in(env, msg)
        if intercepted is None:
            return
        if not self.ready.is_set() and not isinstance(intercepted, (PeerDown, PeerUp, Shutdown)):
            # Not started yet: handlers would see a half-built actor. Even Ping waits,
            # so a peer that pings until it gets an answer knows we are ready.
            self._backlog.append((env, intercepted))
            return
        await self._dispatch_message(env, intercepted)

    async def _dispatch_message(self, env: Envelope, msg: Message) -> None:
        builtin = self._builtin(env, msg)
        if builtin is not None:
            await builtin
            return
        name = self.actor.handlers.get(type(msg))
        if name is None:
            await self._reply_error(
                env, "no_handler", f"{self.role} does not accept {env.tag!r}", 400
            )
            return
        self.spawn(self._dispatch(env, msg, getattr(self.actor, name)))

    def _builtin(self, env: Envelope, msg: Message) -> Awaitable[None] | None:
        """Messages every actor understands, answered by the runtime itself."""
        if isinstance(msg, Ping) and Ping not in self.actor.handlers:
            return self._reply(env, Pong(payload=msg.payload), Kind.REPLY)
        if isinstance(msg, GetStats) and GetStats not in self.actor.handlers:
            return self._reply(env, Stats(role=self.role, values=self.actor.stats()), Kind.REPLY)
        if isinstance(msg, PeerDown):
            return self._peer_down(msg)
        if isinstance(msg, PeerUp):
            return self._peer_up(msg)
        if isinstance(msg, Shutdown):
            self.stop()
            return self._reply(env, Ack(), Kind.REPLY) if env.kind == Kind.REQUEST else _done()
        return None

    async def _peer_down(self, msg: PeerDown) -> None:
        self.down.add(msg.role)
        self._fail_pending(
            lambda p: p.to == msg.role, ActorDied(f"actor {msg.role!r} died: {msg.reason}")
        )
        await self._guard(self.actor.on_peer_down(msg.role, msg.reason), msg)

    async def _peer_up(self, msg: PeerUp) -> None:
        self.down.discard(msg.role)
        old = self.book.get(msg.role)
        self.book[msg.role] = msg.address
        if old and old != msg.address and old in self._outboxes:
            self._outboxes.pop(old).close()
        await self._guard(self.actor.on_peer_up(msg.role), msg)

    async def _guard(self, coro: Awaitable[Any], msg: Message | None) -> None:
        try:
            await coro
        except Exception as exc:
            log.exception("%s: hook failed", self.role)
            with contextlib.suppress(Exception):
                await self.actor.on_failure(exc, msg)

    async def _dispatch(self, env: Envelope, msg: Message, handler: Callable[..., Any]) -> None:
        is_request = env.kind == Kind.REQUEST
        try:
            result = handler(msg, env)
            if inspect.isasyncgen(result):
                async for item in result:
                    await self._reply(env, item, Kind.STREAM)
                await self._reply(env, Ack(), Kind.END)
                return
            if inspect.isawaitable(result):
                result = await result
            if is_request:
                await self._reply(env, result if result is not None else Ack(), Kind.REPLY)
        except asyncio.CancelledError:
            raise
        except Reject as exc:
            await self._reply_error(env, "rejected", exc.reason, exc.status)
        except ActorError as exc:
            await self._reply_error(env, exc.code, str(exc), exc.status)
        except Exception as exc:
            log.exception("%s: handler for %s failed", self.role, env.tag)
            await self._reply_error(
                env, "handler_error", f"{self.role}: {type(exc).__name__}: {exc}", 500
            )
            await self._guard(self.actor.on_failure(exc, msg), msg)


async def _done() -> None:
    return None


def _expire(future: asyncio.Future[Message], to: str, tag: str, limit: float) -> None:
    if not future.done():
        future.set_exception(RequestTimeout(f"{to!r} did not answer {tag!r} within {limit:g}s"))
