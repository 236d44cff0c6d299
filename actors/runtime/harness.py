"""The actor test harness: run one actor in-process and talk to it as any peer.

The actor runs on its real :class:`~actorlm.actors.runtime.ActorRuntime` over a
:class:`~actorlm.actors.transport.MemoryTransport`, so every message still goes
through the codec and the actor's interceptor chain. Every other role is a fake
peer played by the harness: inject messages as any of them, capture what the
actor sends to each, and script their replies to the actor's requests.
Nothing sleeps: :meth:`ActorHarness.settle` runs the event loop until the actor
is idle.

Testing an interceptor (a plugin that caps ``max_new_tokens`` and rejects empty
prompts at the tokenizer)::

    import msgspec
    from actorlm.actors.runtime.harness import ActorHarness
    from actorlm.actors.runtime import RemoteError
    from actorlm.extensions.interceptors import Interceptor, Reject
    from actorlm.messages.generate import GenerateRequest

    def guard(msg, ctx):
        if not msg.text:
            raise Reject("empty prompt")
        if msg.sampling.max_new_tokens > 64:
            capped = msgspec.structs.replace(msg.sampling, max_new_tokens=64)
            return msgspec.structs.replace(msg, sampling=capped)
        return None

    async def test_guard(config):
        chain = [Interceptor("tokenizer", GenerateRequest, "in", guard, "my-plugin")]
        async with ActorHarness(TokenizerActor(config), interceptors=chain) as h:
            await h.send(GenerateRequest(rid="a", text="hi"), sender="gateway")
            sent = h.sent("scheduler")          # what the actor passed on
            assert sent[0].sampling.max_new_tokens <= 64
            with pytest.raises(RemoteError, match="empty prompt"):
                await h.send(GenerateRequest(rid="b", text=""), sender="gateway")

(Without ``interceptors=`` the harness uses every interceptor registered with
``message_interceptor``, as a real actor process would.)

Scripted peers: ``h.on("worker", ForwardBatch, lambda msg: StepResult(...))``
answers every ``ForwardBatch`` request the actor makes to ``worker`` (the
function may be async, return ``None`` for an ``Ack``, raise to send an error, or
be an async generator to stream). Requests nobody scripted stay pending until
the test answers them with :meth:`ActorHarness.reply` or fails them with
:meth:`ActorHarness.peer_down`.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ...extensions.interceptors import Interceptor, InterceptorChain, Reject
from ...messages.base import Message
from ...messages.control import Ack, ErrorReply, PeerDown, PeerUp
from ...messages.envelope import Codec, Envelope, Kind
from ...messages.errors import CallErrorCode
from .dispatch import (
    RUNTIME_MESSAGES,
    Actor,
    ActorError,
    ActorRuntime,
    RemoteError,
    RequestTimeout,
    RuntimeOptions,
)
from .transport import Frames, MemoryTransport

__all__ = ["ActorHarness", "Sent", "check_inbox"]

_SCHEME = "harness://"
SUPERVISOR = "supervisor"


def check_inbox(actor_cls: type[Actor]) -> None:
    """Raise AssertionError unless every handler of ``actor_cls`` can run: the type it
    takes has a wire tag (one without cannot be decoded) and is not answered by the
    runtime itself (``RUNTIME_MESSAGES``)."""
    dead = [
        f"{name} ({t.__name__}: {'no TAG' if not t.TAG else 'the runtime answers it'})"
        for t, name in actor_cls.handlers.items()
        if not t.TAG or t in RUNTIME_MESSAGES
    ]
    if dead:
        raise AssertionError(f"{actor_cls.__name__} has handlers that never run: {', '.join(dead)}")


@dataclass(frozen=True)
class Sent:
    """One message the actor sent: to ``peer``, with its envelope."""

    peer: str
    env: Envelope
    msg: Message

    @property
    def kind(self) -> Kind:
        return Kind(self.env.kind)


class _PeerBook(dict[str, str]):
    """The actor's address book: every role it names is a harness peer."""

    def __init__(self, own: str, book: dict[str, str]) -> None:
        super().__init__(book)
        self._own = own

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key not in self and key != self._own:
            self[key] = _SCHEME + key
        return super().get(key, default)


class _PeerOutbox:
    def __init__(self, harness: ActorHarness, peer: str) -> None:
        self._harness = harness
        self._peer = peer

    async def send(self, frames: Frames) -> None:
        self._harness._from_actor(self._peer, [bytes(f) for f in frames])

    def close(self) -> None:
        pass


class _HarnessTransport(MemoryTransport):
    def __init__(self, harness: ActorHarness) -> None:
        super().__init__()
        self._harness = harness

    def connect(self, address: str, peer: str = "", role: str = "") -> Any:
        if address.startswith(_SCHEME):
            return _PeerOutbox(self._harness, address[len(_SCHEME) :])
        return super().connect(address, peer, role)


Script = Callable[[Any], Any]


class ActorHarness:
    """Runs ``actor`` alone; the test plays every other role. Use ``async with``."""

    def __init__(
        self,
        actor: Actor,
        *,
        interceptors: InterceptorChain | Sequence[Interceptor] | None = None,
        request_timeout_s: float = 5.0,
        max_message_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        self.actor = actor
        self.address = f"memory://{actor.role}"
        self.transport = _HarnessTransport(self)
        if interceptors is not None and not isinstance(interceptors, InterceptorChain):
            interceptors = InterceptorChain(actor.role, list(interceptors))
        options = RuntimeOptions(
            request_timeout_s=request_timeout_s,
            max_message_bytes=max_message_bytes,
            interceptors=interceptors,
            controller=SUPERVISOR,  # the harness plays the supervisor too
        )
        self.runtime = ActorRuntime(actor, self.address, self.transport, options)
        self.runtime.book = _PeerBook(actor.role, self.runtime.book)
        self.codec = Codec(max_message_bytes)
        self.records: list[Sent] = []
        self.problems: list[str] = []  # frames from the actor the harness could not decode
        self._scripts: dict[tuple[str, type[Message]], Script] = {}
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future[Message]] = {}
        self._queues: dict[int, asyncio.Queue[tuple[Kind, Message]]] = {}
        self._send_errors: dict[int, ErrorReply] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._serve: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------
    async def __aenter__(self) -> ActorHarness:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the actor (its ``on_start`` runs) and wait until it serves."""
        self._serve = asyncio.create_task(self.runtime.serve(), name=f"harness-{self.actor.role}")
        ready = asyncio.create_task(self.runtime.ready.wait())
        await asyncio.wait({self._serve, ready}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            self._serve.result()  # on_start raised: raise it here
            raise RuntimeError(f"{self.actor.role} stopped before it was ready")

    async def stop(self) -> None:
        """Stop the actor (its ``on_stop`` runs) and cancel scripted replies in flight."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._serve is not None:
            self.runtime.stop()
            await self._serve
            self._serve = None

    # -- injecting -------------------------------------------------------------
    async def send(self, msg: Message, *, sender: str = "test", settle: bool = True) -> int:
        """Deliver ``msg`` as a fire-and-forget message from ``sender``.

        With ``settle`` (the default) the harness then runs the actor until idle
        and raises :class:`RemoteError` if the actor refused the message
        (an interceptor's ``Reject``, no handler, a handler error)."""
        msg_id = await self._inject(msg, sender, Kind.SEND)
        if settle:
            await self.settle()
            error = self._send_errors.pop(msg_id, None)
            if error is not None:
                raise RemoteError(error.message, code=error.code, status=error.status)
        return msg_id

    async def request(
        self, msg: Message, *, sender: str = "test", timeout: float | None = None
    ) -> Message:
        """Send ``msg`` as a request from ``sender`` and return the actor's reply."""
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        msg_id = next(self._ids)
        self._futures[msg_id] = future
        try:
            await self._inject(msg, sender, Kind.REQUEST, msg_id)
            limit = self.runtime.options.request_timeout_s if timeout is None else timeout
            try:
                return await asyncio.wait_for(future, limit)
            except TimeoutError:
                raise RequestTimeout(
                    f"{self.actor.role} did not answer {msg.TAG!r} within {limit:g}s"
                ) from None
        finally:
            self._futures.pop(msg_id, None)

    async def stream(
        self, msg: Message, *, sender: str = "test", timeout: float | None = None
    ) -> AsyncIterator[Message]:
        """Send ``msg`` as a request and yield the items the actor streams back."""
        queue: asyncio.Queue[tuple[Kind, Message]] = asyncio.Queue()
        msg_id = next(self._ids)
        self._queues[msg_id] = queue
        limit = self.runtime.options.request_timeout_s if timeout is None else timeout
        try:
            await self._inject(msg, sender, Kind.REQUEST, msg_id)
            while True:
                try:
                    kind, item = await asyncio.wait_for(queue.get(), limit)
                except TimeoutError:
                    raise RequestTimeout(
                        f"{self.actor.role} stream for {msg.TAG!r} stalled"
                    ) from None
                if kind == Kind.END:
                    return
                if kind == Kind.ERROR:
                    raise _error(item)
                yield item
        finally:
            self._queues.pop(msg_id, None)

    async def inject_frames(self, frames: Frames) -> None:
        """Put raw frames in the actor's inbox (bad input, foreign producers)."""
        await MemoryTransport.connect(self.transport, self.address).send(frames)

    async def peer_down(self, role: str, reason: str = "killed by the test") -> None:
        """Tell the actor ``role`` died, as the supervisor would; then settle."""
        await self.send(PeerDown(role=role, reason=reason), sender=SUPERVISOR)

    async def peer_up(self, role: str) -> None:
        await self.send(PeerUp(role=role, address=_SCHEME + role), sender=SUPERVISOR)

    async def _inject(
        self, msg: Message, sender: str, kind: Kind, msg_id: int | None = None
    ) -> int:
        msg_id = next(self._ids) if msg_id is None else msg_id
        env = Envelope(msg.TAG, msg_id, sender, kind, 0, _SCHEME + sender)
        await self.inject_frames(self.codec.encode(env, msg))
        return msg_id

    # -- capturing -------------------------------------------------------------
    def sent(self, peer: str | None = None, kinds: Iterable[Kind] | None = None) -> list[Message]:
        """Messages the actor sent to ``peer`` (every peer when None), replies included."""
        return [r.msg for r in self.sent_records(peer, kinds)]

    def sent_records(
        self, peer: str | None = None, kinds: Iterable[Kind] | None = None
    ) -> list[Sent]:
        wanted = set(kinds) if kinds is not None else None
        return [
            r
            for r in self.records
            if (peer is None or r.peer == peer) and (wanted is None or r.kind in wanted)
        ]

    def sent_types(self, peer: str | None = None) -> list[type[Message]]:
        return [type(m) for m in self.sent(peer)]

    def clear(self, peer: str | None = None) -> None:
        self.records = [] if peer is None else [r for r in self.records if r.peer != peer]

    # -- fake peers ------------------------------------------------------------
    def on(self, peer: str, msg_type: type[Message], fn: Script) -> None:
        """Script ``peer``: call ``fn(msg)`` for each ``msg_type`` the actor sends it.

        For a request, the result is the reply (``None`` → ``Ack``; an async
        generator streams; an exception becomes an error reply). For a plain
        send, a returned message is sent back to the actor from ``peer``."""
        self._scripts[(peer, msg_type)] = fn

    async def reply(self, record: Sent, msg: Message) -> None:
        """Answer a request the actor made (one nobody scripted)."""
        await self._respond(record, msg, Kind.ERROR if isinstance(msg, ErrorReply) else Kind.REPLY)

    async def _respond(self, record: Sent, msg: Message, kind: Kind) -> None:
        env = Envelope(
            msg.TAG, next(self._ids), record.peer, kind, record.env.id, _SCHEME + record.peer
        )
        await self.inject_frames(self.codec.encode(env, msg))

    def _from_actor(self, peer: str, frames: list[bytes]) -> None:
        try:
            env, msg = self.codec.decode(frames)
        except Exception as exc:  # the actor produced frames no peer could read
            self.problems.append(f"{self.actor.role} → {peer}: {exc}")
            return
        record = Sent(peer, env, msg)
        self.records.append(record)
        if env.kind >= Kind.REPLY:
            self._deliver(env, msg)
            return
        script = self._script_for(peer, type(msg))
        if script is not None:
            task = asyncio.get_running_loop().create_task(self._run_script(script, record))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _script_for(self, peer: str, typ: type[Message]) -> Script | None:
        for klass in typ.__mro__:
            fn = self._scripts.get((peer, klass))
            if fn is not None:
                return fn
        return None

    async def _run_script(self, fn: Script, record: Sent) -> None:
        is_request = record.kind == Kind.REQUEST
        try:
            result = fn(record.msg)
            if inspect.isasyncgen(result):
                async for item in result:
                    await self._respond(record, cast(Message, item), Kind.STREAM)
                await self._respond(record, Ack(), Kind.END)
                return
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if is_request:
                code, status = CallErrorCode.HANDLER_ERROR, 500
                if isinstance(exc, ActorError):
                    code, status = exc.code, exc.status
                elif isinstance(exc, Reject):
                    code, status = CallErrorCode.REJECTED, exc.status
                await self._respond(
                    record, ErrorReply(code=code, message=str(exc), status=status), Kind.ERROR
                )
            else:
                self.problems.append(f"script for {record.peer} {record.env.tag} raised {exc!r}")
            return
        if is_request:
            await self._respond(record, result if result is not None else Ack(), Kind.REPLY)
        elif result is not None:
            env = Envelope(
                result.TAG, next(self._ids), record.peer, Kind.SEND, 0, _SCHEME + record.peer
            )
            await self.inject_frames(self.codec.encode(env, result))

    def _deliver(self, env: Envelope, msg: Message) -> None:
        kind = Kind(env.kind)
        queue = self._queues.get(env.reply_to)
        if queue is not None:
            queue.put_nowait((kind, msg))
            return
        future = self._futures.get(env.reply_to)
        if future is not None and not future.done():
            if kind == Kind.ERROR and isinstance(msg, ErrorReply):
                future.set_exception(_error(msg))
            else:
                future.set_result(msg)
        elif kind == Kind.ERROR and isinstance(msg, ErrorReply):
            self._send_errors[env.reply_to] = msg

    # -- time ------------------------------------------------------------------
    async def settle(self, max_steps: int = 100_000) -> None:
        """Run the loop until the actor is idle: its inbox is empty and no task
        is runnable. Timers (``asyncio.sleep``) and threads are not waited for.
        Raises AssertionError if the actor sent frames the harness cannot decode."""
        loop = asyncio.get_running_loop()
        ready = getattr(loop, "_ready", None)  # the loop's run queue (asyncio's, not uvloop's)
        # With the run queue visible, two empty looks in a row mean idle; without
        # it (other loops) a long run of steps with nothing queued stands in.
        needed = 2 if ready is not None else 64
        quiet = 0
        for _ in range(max_steps):
            await asyncio.sleep(0)
            busy = self.transport.pending() > 0 or (ready is not None and len(ready) > 0)
            quiet = 0 if busy else quiet + 1
            if quiet >= needed:
                break
        else:
            raise RuntimeError(f"{self.actor.role} did not settle within {max_steps} loop steps")
        if self.problems:
            raise AssertionError("; ".join(self.problems))


def _error(reply: Message) -> ActorError:
    assert isinstance(reply, ErrorReply)
    return RemoteError(reply.message, code=reply.code, status=reply.status)
