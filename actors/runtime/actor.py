"""The Actor base class: what an actor declares and what it can do.

An actor declares the messages it accepts by its handlers: each ``@handles``
method names the types it takes, and those types are the actor's ``inbox``::

    class Echo(Actor):
        role = "echo"

        @handles(Ping)
        async def on_ping(self, msg: Ping, env: Envelope) -> Pong:
            return Pong(payload=msg.payload)

A handler returns a reply (sent when the message was a request), ``None``, or is
an async generator whose items stream back to the requester. Callers use
``send`` (fire and forget), ``request`` (one reply, with a timeout) and
``stream`` (many replies). The :class:`~actorlm.actors.runtime.ActorRuntime`
that adopts an actor receives, dispatches and sends for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ...config import EngineConfig
from ...messages.base import Message
from ...messages.control import ErrorReply
from ...messages.envelope import Envelope

if TYPE_CHECKING:
    from .dispatch import ActorRuntime

__all__ = ["Actor", "handles"]

T = TypeVar("T")


def handles(*types: type[Message]) -> Callable[[T], T]:
    """Mark an actor method as the handler of ``types``."""

    def decorator(fn: T) -> T:
        fn._actorlm_handles = types  # type: ignore[attr-defined]
        return fn

    return decorator


class Actor:
    """Base class: subclasses set ``role`` and decorate handlers (``@handles``).

    ``handlers`` (message type → method name) and ``inbox`` (the types accepted) are
    derived from the decorated methods, the base classes' included; a subclass's
    handler for a type replaces its base's."""

    role: ClassVar[str] = ""
    inbox: ClassVar[tuple[type[Message], ...]] = ()
    handlers: ClassVar[dict[type[Message], str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "inbox" in vars(cls):
            # A second list beside the handlers would only drift from them.
            raise TypeError(
                f"{cls.__qualname__} sets inbox: an actor's inbox is the types its "
                "@handles methods name; drop the tuple"
            )
        table: dict[type[Message], str] = {}
        for klass in reversed(cls.__mro__):
            own: dict[type[Message], str] = {}
            for name, fn in vars(klass).items():
                for typ in getattr(fn, "_actorlm_handles", ()):
                    if typ in own:  # one of the two would never run
                        raise TypeError(
                            f"{klass.__qualname__} handles {typ.__name__} twice: "
                            f"{own[typ]} and {name}"
                        )
                    own[typ] = name
            table.update(own)
        cls.handlers = table
        cls.inbox = tuple(table)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runtime: ActorRuntime  # set when the runtime adopts the actor

    # -- lifecycle (override) -------------------------------------------------
    async def on_start(self) -> None:
        """Runs before READY is announced: load models, connect to peers."""

    async def before_stop(self) -> None:
        """Runs when the actor is told to stop (``Shutdown``, SIGTERM), while it can still
        send and receive: drain what is in flight here. Then it stops."""

    async def on_stop(self) -> None:
        """Runs once on shutdown, after the inbox is closed."""

    async def on_failure(self, exc: BaseException, msg: Message | None) -> None:
        """A handler raised ``exc`` while handling ``msg`` (the actor keeps running)."""

    async def on_peer_down(self, role: str, reason: str) -> None:
        """``role`` is gone (its process exited, it fell silent, or it restarted: then
        ``reason`` is "restarted" and ``on_peer_up`` follows). Pending calls to it have
        failed already; whatever state it held is lost."""

    async def on_peer_up(self, role: str) -> None:
        """``role`` is alive: heard from for the first time, again, or as a new
        incarnation (``self.runtime.peer_incarnation(role)``)."""

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
