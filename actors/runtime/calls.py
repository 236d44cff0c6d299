"""Calls in flight: the replies an actor waits for, and how a call fails.

Every ``request`` and ``stream`` an actor makes is a :class:`Call` in its
:class:`Calls`, under the message id of what it sent. A reply finds its call by
that id. A request's call has a deadline; a stream's call bounds each item's
wait itself. When a peer dies, every call to it fails at once with
:class:`ActorDied`.

Deadlines share one loop timer, armed for the earliest deadline in flight. A
timer per request (``wait_for``, or ``call_later`` and ``cancel``) would cost a
timer handle on every request and, on uvloop, an extra loop round to close it;
with one timeout for all requests a new deadline is never the earliest, so a
request costs no timer work at all.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from ...messages.base import Message
from ...messages.control import ErrorReply
from ...messages.envelope import Kind
from ...messages.errors import CallErrorCode

__all__ = [
    "ActorDied",
    "ActorError",
    "Call",
    "Calls",
    "RemoteError",
    "RequestTimeout",
    "error_from_reply",
]


class ActorError(Exception):
    """A failed call to another actor. ``code`` is stable; ``status`` HTTP-like."""

    code = CallErrorCode.ACTOR_ERROR
    status = 500

    def __init__(
        self, message: str, *, code: CallErrorCode | None = None, status: int | None = None
    ) -> None:
        super().__init__(message)
        if code is not None:
            # A code the wire cannot carry fails here, where it is raised, not in the
            # caller's decoder (an ErrorReply with an unknown code does not decode).
            self.code = CallErrorCode(code)
        if status is not None:
            self.status = status


class RequestTimeout(ActorError):
    code, status = CallErrorCode.TIMEOUT, 504


class ActorDied(ActorError):
    code, status = CallErrorCode.ACTOR_DIED, 503


class RemoteError(ActorError):
    """The peer answered with an ErrorReply."""


def error_from_reply(reply: ErrorReply) -> ActorError:
    cls = ActorDied if reply.code is CallErrorCode.ACTOR_DIED else RemoteError
    return cls(reply.message, code=reply.code, status=reply.status)


# A deadline this close counts as passed: loop timers fire to the millisecond.
_TIMER_SLACK_S = 0.001


@dataclass(slots=True)
class Call:
    """One request (a future and its deadline, in loop time) or stream (a queue
    of ``(kind, item)``) to ``to``."""

    to: str
    future: asyncio.Future[Message] | None = None
    queue: asyncio.Queue[tuple[int, Message]] | None = None
    deadline: float = math.inf
    tag: str = ""  # for the timeout's message
    timeout: float = 0.0


class Calls:
    """This actor's calls in flight, by the message id they were sent with."""

    def __init__(self) -> None:
        self._calls: dict[int, Call] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf  # never after the earliest deadline in flight

    def __contains__(self, msg_id: int) -> bool:
        return msg_id in self._calls

    def request(self, msg_id: int, to: str, tag: str, timeout: float) -> asyncio.Future[Message]:
        """A future for the one reply; it fails with RequestTimeout after ``timeout`` s."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Message] = loop.create_future()
        deadline = loop.time() + timeout
        self._calls[msg_id] = Call(to, future, deadline=deadline, tag=tag, timeout=timeout)
        if deadline < self._timer_at:
            self._arm(loop, deadline)
        return future

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_at(when, self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fail the requests whose deadline passed; re-arm for the earliest left."""
        self._timer, self._timer_at = None, math.inf
        now = loop.time() + _TIMER_SLACK_S
        earliest = math.inf
        for call in list(self._calls.values()):
            future = call.future
            if future is None or future.done():
                continue
            if call.deadline <= now:
                limit = call.timeout
                message = f"{call.to!r} did not answer {call.tag!r} within {limit:g}s"
                future.set_exception(RequestTimeout(message))
            elif call.deadline < earliest:
                earliest = call.deadline
        if earliest < math.inf:
            self._arm(loop, earliest)

    def stream(self, msg_id: int, to: str) -> asyncio.Queue[tuple[int, Message]]:
        """A queue of ``(kind, item)``: STREAM items, then END or ERROR."""
        queue: asyncio.Queue[tuple[int, Message]] = asyncio.Queue()
        self._calls[msg_id] = Call(to, queue=queue)
        return queue

    def finish(self, msg_id: int) -> None:
        """Forget a call (answered, timed out or abandoned); a late reply is ignored."""
        self._calls.pop(msg_id, None)

    def deliver(self, msg_id: int, kind: int, msg: Message) -> None:
        """Hand a reply (or an ErrorReply, as the call's error) to its call."""
        call = self._calls.get(msg_id)
        if call is None:
            return
        if call.queue is not None:
            call.queue.put_nowait((kind, msg))
        elif call.future is not None and not call.future.done():
            if kind == Kind.ERROR and isinstance(msg, ErrorReply):
                call.future.set_exception(error_from_reply(msg))
            else:
                call.future.set_result(msg)

    def fail(self, exc: ActorError, to: str | None = None) -> None:
        """Fail every call (to ``to``, or all) with ``exc`` at once."""
        reply = ErrorReply(code=exc.code, message=str(exc), status=exc.status)
        for msg_id, call in list(self._calls.items()):
            if to is None or call.to == to:
                self.deliver(msg_id, Kind.ERROR, reply)
