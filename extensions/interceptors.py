"""Message interceptors: plugin functions on the messages between actors.

Register a function for (actor role, message type, direction)::

    from actorlm.extensions.interceptors import DROP, Reject, message_interceptor

    @message_interceptor("scheduler", TokenizedRequest, "in")
    def cap_tokens(msg, ctx):
        if msg.sampling.max_new_tokens > 64:
            return msgspec.structs.replace(msg, sampling=...)   # rewrite
        return None                                             # observe: keep as is

A function (sync or async) gets ``(msg, ctx)`` and returns ``None`` (keep the
message), a message (use it instead), ``DROP`` (discard it silently), or raises
``Reject(reason)`` (discard it and send the requester an error; the actor keeps
running). Any other exception is logged with the interceptor's plugin and the
message passes on unchanged: a broken plugin never kills an actor.

Order: interceptors run in registration order (plugins register in name order),
each seeing the previous one's output; a DROP or Reject stops the chain. ``role``
``"*"`` matches every actor and message type ``None`` every message. Inbound
interceptors run after decoding and before the handler; outbound ones before
encoding. Everything runs in the actor's own process.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .registry import current_source

__all__ = [
    "DROP",
    "InterceptContext",
    "Interceptor",
    "InterceptorChain",
    "Reject",
    "clear_interceptors",
    "interceptors",
    "message_interceptor",
    "register_interceptor",
]

log = logging.getLogger(__name__)

Direction = Literal["in", "out"]
DROP: Any = object()  # return this from an interceptor to discard the message


class Reject(Exception):
    """Raise from an interceptor to refuse a message; the requester gets ``reason``."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class InterceptContext:
    role: str  # the actor this runs in
    direction: Direction
    peer: str  # sender for "in", destination for "out"
    tag: str


@dataclass(frozen=True)
class Interceptor:
    role: str
    msg_type: type | None
    direction: Direction
    fn: Callable[..., Any]
    source: str

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


_INTERCEPTORS: list[Interceptor] = []


def register_interceptor(
    role: str,
    msg_type: type | None,
    direction: Direction,
    fn: Callable[..., Any],
    *,
    source: str | None = None,
) -> Interceptor:
    if direction not in ("in", "out"):
        raise ValueError(f"direction must be 'in' or 'out', not {direction!r}")
    entry = Interceptor(role, msg_type, direction, fn, source or current_source.get())
    _INTERCEPTORS.append(entry)
    return entry


def message_interceptor(
    role: str, msg_type: type | None = None, direction: Direction = "in"
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        register_interceptor(role, msg_type, direction, fn)
        return fn

    return decorator


def interceptors() -> list[Interceptor]:
    return list(_INTERCEPTORS)


def clear_interceptors() -> None:
    """Forget every interceptor (tests)."""
    _INTERCEPTORS.clear()


class InterceptorChain:
    """The interceptors of one actor, looked up by (direction, message type) once."""

    def __init__(self, role: str, entries: list[Interceptor] | None = None) -> None:
        self.role = role
        self._entries = [
            e for e in (_INTERCEPTORS if entries is None else entries) if e.role in ("*", role)
        ]
        self._cache: dict[tuple[str, type], list[Interceptor]] = {}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def _for(self, direction: str, msg_type: type) -> list[Interceptor]:
        key = (direction, msg_type)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = [
                e
                for e in self._entries
                if e.direction == direction
                and (e.msg_type is None or issubclass(msg_type, e.msg_type))
            ]
        return found

    async def run(self, msg: Any, direction: Direction, peer: str, tag: str) -> Any:
        """The message after every matching interceptor, or DROP; raises Reject."""
        chain = self._for(direction, type(msg))
        if not chain:
            return msg
        ctx = InterceptContext(self.role, direction, peer, tag)
        for entry in chain:
            try:
                out = entry.fn(msg, ctx)
                if inspect.isawaitable(out):
                    out = await out
            except Reject:
                raise
            except Exception:
                log.exception(
                    "interceptor %s from plugin %r failed on %s; message passed on unchanged",
                    entry.name,
                    entry.source,
                    tag,
                )
                continue
            if out is DROP:
                return DROP
            if out is not None:
                msg = out
        return msg
