"""The client end of the pipeline, shared by the HTTP gateway and the Python Engine.

A :class:`ClientActor` lives in the caller's process and event loop. It sends
``GenerateRequest`` to the tokenizer and receives batched ``TextBatch``
outputs, which :class:`EngineClient` fans out to one queue per request. When a
pipeline actor dies, every in-flight request ends at once with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from ..config import EngineConfig
from ..messages.control import (
    DrainReplica,
    ErrorReply,
    FlushCache,
    GetInfo,
    GetStats,
    Info,
    Stats,
)
from ..messages.envelope import Envelope
from ..messages.errors import HTTP_STATUS, CallErrorCode, ErrorCode, code_for_status
from ..messages.generate import (
    AbortRequest,
    FinishReason,
    GenerateRequest,
    TextBatch,
    TextDelta,
)
from ..messages.lora import (
    ListLoraAdapters,
    LoadLoraAdapter,
    LoraAdapterInfo,
    LoraAdapterList,
    UnloadLoraAdapter,
)
from .replicas import replica_count, replica_members, replica_role
from .runtime import Actor, ActorError, handles

__all__ = [
    "LORA_ROLE",
    "PIPELINE_ROLES",
    "ClientActor",
    "EngineClient",
    "RequestFailed",
    "blocking_down",
    "pipeline_roles",
]

PIPELINE_ROLES = ("tokenizer", "scheduler", "cache_manager", "worker")
LORA_ROLE = "lora_loader"


def pipeline_roles(config: EngineConfig) -> tuple[str, ...]:
    """The actors ``config`` runs: the pipeline (each data-parallel replica's scheduler,
    cache manager and worker), and the lora_loader when LoRA is on."""
    roles: tuple[str, ...] = PIPELINE_ROLES
    extra = range(1, replica_count(config.router))
    roles = (*PIPELINE_ROLES, *(r for i in extra for r in replica_members(i)))
    return (*roles, LORA_ROLE) if config.lora.enabled else roles


def blocking_down(config: EngineConfig, down: set[str]) -> list[str]:
    """The roles down now that stop every request: any pipeline actor of the single
    pipeline; with replicas, the tokenizer, or some member of every replica. A prefill
    replica stops nothing: its decode replicas prefill themselves while it is down."""
    if config.router.dp_size <= 1:
        return sorted(set(PIPELINE_ROLES) & down)
    replicas = [set(replica_members(i)) & down for i in range(config.router.dp_size)]
    lost = sorted(set().union(*replicas)) if all(replicas) else []
    return sorted({"tokenizer"} & down) + lost


class RequestFailed(Exception):
    """A generate request ended with an error: ``code`` says why, ``status`` is its HTTP
    status (400, 413, 503...)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.code]


class ClientActor(Actor):
    role = "client"

    def __init__(self, config: EngineConfig, role: str = "") -> None:
        super().__init__(config)
        self.role = role or f"client-{os.getpid()}-{uuid.uuid4().hex[:6]}"  # type: ignore[misc]
        self.streams: dict[str, asyncio.Queue[TextDelta]] = {}
        self.sent: dict[int, str] = {}  # message id of a GenerateRequest → rid

    @handles(TextBatch)
    async def on_text(self, msg: TextBatch, env: Envelope) -> None:
        for delta in msg.items:
            queue = self.streams.get(delta.rid)
            if queue is not None:
                queue.put_nowait(delta)

    def fail_all(self, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE) -> None:
        for rid, queue in self.streams.items():
            queue.put_nowait(
                TextDelta(rid=rid, finish_reason=FinishReason.ERROR, error=message, error_code=code)
            )

    async def on_peer_down(self, role: str, reason: str) -> None:
        # The tokenizer and the scheduler hold every stream; a lost worker or cache
        # manager is the scheduler's to handle (it fails or recomputes what ran there).
        # With replicas a scheduler holds only its own: the tokenizer ends those.
        if role == "tokenizer" or (role == "scheduler" and self.config.router.dp_size <= 1):
            self.fail_all(f"the {role} actor died ({reason}); request aborted")

    async def on_error(self, env: Envelope, error: ErrorReply) -> None:
        rid = self.sent.pop(env.reply_to, None)
        queue = self.streams.get(rid) if rid else None
        if queue is not None:
            queue.put_nowait(
                TextDelta(
                    rid=rid or "",
                    finish_reason=FinishReason.ERROR,
                    error=error.message,
                    error_code=code_for_status(error.status),
                )
            )


class EngineClient:
    """Async API over the actors: ``generate`` streams ``TextDelta`` for one request."""

    def __init__(self, actor: ClientActor, tokenizer: str = "tokenizer") -> None:
        self.actor = actor
        self.tokenizer = tokenizer
        self._rids = itertools.count()

    @property
    def in_flight(self) -> int:
        return len(self.actor.streams)

    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:16]}{next(self._rids)}"

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TextDelta, None]:
        """Yield deltas until one has ``finish_reason``. Errors come as a final delta
        with ``finish_reason=FinishReason.ERROR``; closing the iterator early aborts the request."""
        if req.rid in self.actor.streams:
            raise RequestFailed(
                f"request id {req.rid!r} is already in flight", ErrorCode.INVALID_REQUEST
            )
        queue: asyncio.Queue[TextDelta] = asyncio.Queue()
        self.actor.streams[req.rid] = queue
        finished = False
        msg_id = 0
        try:
            try:
                msg_id = await self.actor.send(self.tokenizer, req)
            except ActorError as exc:
                raise RequestFailed(str(exc), code_for_status(exc.status)) from None
            self.actor.sent[msg_id] = req.rid
            while True:
                delta = await queue.get()
                if delta.finish_reason is not None:
                    finished = True
                yield delta
                if finished:
                    return
        finally:
            self.actor.streams.pop(req.rid, None)
            self.actor.sent.pop(msg_id, None)
            if not finished:
                await self.abort(req.rid)

    async def abort(self, rid: str) -> None:
        """Stop ``rid`` wherever it is; its KV pages are returned."""
        for role in ("tokenizer", "scheduler"):
            if role not in self.actor.runtime.down:
                with contextlib.suppress(ActorError):
                    await self.actor.send(role, AbortRequest(rid=rid))

    async def flush_cache(self) -> bool:
        """Flush every replica's prefix cache; True if each was flushed whole."""
        ok = True
        for i in range(replica_count(self.actor.config.router)):
            role = replica_role("cache_manager", i)
            reply = await self.actor.request(role, FlushCache(), timeout=30)
            ok = ok and bool(getattr(reply, "ok", False))
        return ok

    async def stats(self) -> dict[str, dict[str, Any]]:
        """Every pipeline actor's stats (an actor that is down is reported as such)."""

        async def one(role: str) -> tuple[str, dict[str, Any]]:
            try:
                reply = await self.actor.request(role, GetStats(), timeout=5)
            except ActorError as exc:
                return role, {"error": str(exc)}
            return role, dict(reply.values) if isinstance(reply, Stats) else {}

        pairs = await asyncio.gather(*(one(r) for r in pipeline_roles(self.actor.config)))
        return dict(pairs)

    # -- LoRA adapters (the lora_loader's registry) ---------------------------------
    def _lora(self) -> None:
        if not self.actor.config.lora.enabled:
            raise ActorError(
                "LoRA is not enabled on this server; start it with --enable-lora or --lora-paths",
                code=CallErrorCode.LORA_DISABLED,
                status=400,
            )

    async def load_lora(self, name: str, path: str, pinned: bool = False) -> LoraAdapterInfo:
        """Register the PEFT adapter at ``path`` as ``name`` (ActorError with a 4xx
        status when it cannot be served)."""
        self._lora()
        msg = LoadLoraAdapter(lora_name=name, lora_path=path, pinned=pinned)
        reply = await self.actor.request(LORA_ROLE, msg)
        assert isinstance(reply, LoraAdapterInfo)
        return reply

    async def unload_lora(self, name: str) -> LoraAdapterInfo:
        """Unload ``name``; returns once no request uses it any more."""
        self._lora()
        reply = await self.actor.request(LORA_ROLE, UnloadLoraAdapter(lora_name=name))
        assert isinstance(reply, LoraAdapterInfo)
        return reply

    async def lora_adapters(self) -> list[LoraAdapterInfo]:
        """The adapters requests can name now (none when LoRA is off)."""
        if not self.actor.config.lora.enabled:
            return []
        reply = await self.actor.request(LORA_ROLE, ListLoraAdapters(), timeout=10)
        assert isinstance(reply, LoraAdapterList)
        return [a for a in reply.adapters if not a.unloading]

    async def drain_replica(self, replica: int, drain: bool = True) -> int:
        """Take data-parallel replica ``replica`` out of the router (or back); its load."""
        reply = await self.actor.request(self.tokenizer, DrainReplica(replica=replica, drain=drain))
        return int(reply.values["load"]) if isinstance(reply, Info) else 0

    async def info(self, role: str = "worker") -> dict[str, Any]:
        reply = await self.actor.request(role, GetInfo(), timeout=10)
        return dict(reply.values) if isinstance(reply, Info) else {}
