"""TokenizerActor: text in, token ids to the scheduler; token ids back, text out.

It validates requests (the first place that knows a prompt's length), renders
chat templates, and turns each step's ``TokenBatch`` into one ``TextBatch`` per
client with incremental text, stop strings held back and cut, and logprob
strings. Long inputs are tokenized in a thread so the loop keeps streaming.

With data-parallel replicas (``--dp-size`` > 1) its router (``actors.router``) picks
each request's replica and sends it to that replica's scheduler; the replicas' cache
managers tell it what their caches hold (``CacheEvents``). A replica's scheduler that
dies ends that replica's requests alone; the router sends nothing to a replica while
any of its members is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from ...config import EngineConfig
from ...messages.cache import CacheEvents
from ...messages.control import DrainReplica, ErrorReply, GetInfo, Info
from ...messages.envelope import Envelope
from ...messages.errors import CallErrorCode, ErrorCode, code_for_status
from ...messages.generate import (
    AbortRequest,
    FinishReason,
    FinishRequest,
    GenerateRequest,
    TextBatch,
    TextDelta,
    TokenBatch,
    TokenizedRequest,
    Usage,
)
from ...messages.sampling import SamplingParams
from ..replicas import REPLICA_ROLES, base_role
from ..router.core import Router
from ..runtime import Actor, ActorError, handles
from .detokenize import TextStream, stream_batch, token_logprobs
from .reasoning import ReasoningFormat, ReasoningSplitter

__all__ = ["TokenizerActor"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Inputs longer than this are tokenized off the event loop (the thread hop costs ~0.1 ms).
_INLINE_CHARS = 4096
# A token is rarely more than a few characters: a prompt this many times the context
# cannot fit, and is refused before the tokenizer spends memory on it.
_CHARS_PER_TOKEN_BOUND = 64
# Chat templates render in threads, at most this many at once (a slow one holds a thread).
_RENDERS = 2
# Arguments of the render itself, which chat_template_kwargs cannot replace.
_RESERVED_TEMPLATE_ARGS = frozenset(
    {"messages", "conversation", "add_generation_prompt", "tokenize", "return_dict",
     "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"}
)  # fmt: skip


class RequestError(Exception):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.code = code


async def _daemon_thread(fn: Callable[[], T], done: Callable[[], None]) -> T:
    """``fn()`` in a daemon thread (an executor's threads are joined at exit: a runaway
    render would hold the process up); ``done`` runs, on the loop, when it ends."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        done()
        if future.done():  # its caller gave up (the time limit)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        outcome: tuple[T | None, BaseException | None]
        try:
            outcome = (fn(), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed while this ran
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="chat-template", daemon=True).start()
    return await future


@dataclass
class _Live:
    reply_to: str
    stream: TextStream
    prompt_tokens: int
    logprobs: bool
    msg_id: int = 0
    scheduler: str = "scheduler"  # the replica's scheduler computing it
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning: ReasoningSplitter | None = None  # thinking apart from the answer

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """``(reasoning, content)`` of this step's text."""
        if self.reasoning is None:
            return "", text
        thought, content = self.reasoning.push(text)
        if final:
            more = self.reasoning.flush()
            thought, content = thought + more[0], content + more[1]
        return thought, content


class TokenizerActor(Actor):
    role = "tokenizer"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # Made now: replicas' liveness and cache events may come while on_start loads.
        self.router = Router(config) if config.router.dp_size > 1 else None

    async def on_start(self) -> None:
        from .tokenization import load_tokenizer

        self.tok = await self.run_blocking(load_tokenizer, self.config.model.path)
        self.max_model_len = self.config.model.max_model_len
        self.live: dict[str, _Live] = {}
        self.tokenizing: set[str] = set()
        self.sent: dict[int, str] = {}  # TokenizedRequest message id → rid
        self.requests = 0
        server = self.config.server
        self.max_prompt_chars = server.max_prompt_chars or _CHARS_PER_TOKEN_BOUND * (
            self.max_model_len or 8192
        )
        self._renders = asyncio.Semaphore(_RENDERS)
        self.reasoning_format: ReasoningFormat | None = None
        if self.config.grammar.reasoning_parser:
            from ...extensions.points import REASONING_PARSERS

            self.reasoning_format = REASONING_PARSERS.get(self.config.grammar.reasoning_parser)

    def ready_info(self) -> dict[str, Any]:
        template = self.tok.chat_template or ""
        return {
            "vocab_size": self.tok.vocab_size,
            "chat_template": bool(template),
            # Templates that render a request's tools name them; the gateway lets the
            # model choose a call (tool_choice "auto") only then.
            "chat_template_tools": "tools" in template,
        }

    @handles(GetInfo)
    async def on_info(self, msg: GetInfo, env: Envelope) -> Info:
        return Info(role=self.role, values=self.ready_info())

    def stats(self) -> dict[str, Any]:
        router = self.router.stats() if self.router is not None else {}
        return {"live": len(self.live), "requests": self.requests, **router}

    # -- requests in ----------------------------------------------------------
    @handles(GenerateRequest)
    async def on_generate(self, req: GenerateRequest, env: Envelope) -> None:
        reply_to = req.reply_to or env.sender
        self.requests += 1
        if req.rid in self.live or req.rid in self.tokenizing:
            await self._fail(
                reply_to,
                req.rid,
                f"request id {req.rid!r} is already in use",
                ErrorCode.INVALID_REQUEST,
            )
            return
        self.tokenizing.add(req.rid)
        try:
            ids = await self._tokenize(req)
            sampling = self._check(req, ids)
        except (RequestError, ValueError) as exc:
            self.tokenizing.discard(req.rid)
            code = exc.code if isinstance(exc, RequestError) else ErrorCode.INVALID_REQUEST
            await self._fail(reply_to, req.rid, str(exc), code)
            return
        except Exception as exc:  # a bug: the request fails, the actor and its books stay whole
            log.exception("tokenizing %s failed", req.rid)
            self.tokenizing.discard(req.rid)
            await self._fail(reply_to, req.rid, f"tokenizing failed: {exc!r}", ErrorCode.INTERNAL)
            return
        if req.rid not in self.tokenizing:  # aborted while we tokenized
            await self._fail(
                reply_to, req.rid, "", None, reason=FinishReason.ABORT, prompt_tokens=len(ids)
            )
            return
        self.tokenizing.discard(req.rid)
        scheduler = "scheduler"
        if self.router is not None:
            scheduler = self.router.route(req.rid, ids) or ""
            if not scheduler:
                why = "every replica has an actor down; try again shortly"
                await self._fail(reply_to, req.rid, why, ErrorCode.UNAVAILABLE)
                return
        self.live[req.rid] = _Live(
            reply_to,
            TextStream(self.tok, req.sampling),
            len(ids),
            req.sampling.logprobs,
            scheduler=scheduler,
            reasoning=self._splitter(req, ids),
        )
        out = TokenizedRequest(
            rid=req.rid,
            input_ids=ids,
            sampling=sampling,
            eos_token_ids=list(self.tok.eos_token_ids),
            priority=req.priority,
            lora_path=req.lora_path,
        )
        try:
            msg_id = await self.send(scheduler, out)
        except ActorError as exc:
            self._forget(req.rid)
            await self._fail(reply_to, req.rid, str(exc), code_for_status(exc.status))
            return
        if req.rid in self.live:  # it may have finished while we were sending
            self.sent[msg_id] = req.rid
            self.live[req.rid].msg_id = msg_id

    async def _tokenize(self, req: GenerateRequest) -> list[int]:
        given = [x is not None for x in (req.text, req.messages, req.input_ids)]
        if sum(given) != 1:
            raise RequestError("give exactly one of text, messages or input_ids")
        if req.input_ids is not None:
            bad = [t for t in req.input_ids if not 0 <= t < self.tok.vocab_size]
            if bad:
                raise RequestError(
                    f"input_ids out of the vocabulary (size {self.tok.vocab_size}): {bad[:5]}"
                )
            return list(req.input_ids)
        if req.messages is not None:
            if not req.messages:
                raise RequestError("messages must not be empty")
            self._bound(sum(len(str(m.content or "")) for m in req.messages))
            return await self._render(req)
        text = req.text or ""
        self._bound(len(text))
        if len(text) <= _INLINE_CHARS:
            return self.tok.encode(text)
        return await self.run_blocking(self.tok.encode, text)

    def _splitter(self, req: GenerateRequest, ids: list[int]) -> ReasoningSplitter | None:
        fmt = self.reasoning_format
        if fmt is None or not req.separate_reasoning:
            return None
        # Where the prompt leaves the output: inside a think block the template opened,
        # after one it closed, or neither (the worker's reasoner reads it the same way).
        tail = self.tok.decode(ids[-32:], skip_special_tokens=False)
        return ReasoningSplitter(fmt, fmt.initial_state(tail))

    def _bound(self, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise RequestError(
                f"the prompt has {chars} characters; this server takes at most "
                f"{self.max_prompt_chars} (--max-prompt-chars)",
                ErrorCode.TOO_LARGE,
            )

    async def _render(self, req: GenerateRequest) -> list[int]:
        """The chat's token ids, its template rendered off the loop within a time limit,
        so no template (the model's, given odd arguments, or a trusted request's own)
        stalls this actor. A render past the limit fails its request at once but keeps
        its thread (and its slot: at most ``_RENDERS`` run at a time) until it ends; the
        thread is a daemon, so it never holds up the process's exit."""
        kwargs = dict(req.chat_template_kwargs)
        taken = sorted(_RESERVED_TEMPLATE_ARGS & set(kwargs))
        if taken:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(taken)}")
        if "chat_template" in kwargs and not self.config.server.trust_request_chat_template:
            raise RequestError(
                "chat templates sent with a request are refused (the operator can allow them "
                "with --trust-request-chat-template)"
            )
        limit = self.config.server.chat_template_timeout_s
        messages, prompt = list(req.messages or []), req.add_generation_prompt

        def render() -> list[int]:
            return self.tok.apply_chat_template(messages, prompt, **kwargs)

        try:
            async with asyncio.timeout(limit):
                await self._renders.acquire()
                return await _daemon_thread(render, self._renders.release)
        except TimeoutError:
            raise RequestError(f"the chat template took longer than {limit:g}s to render") from None

    def _check(self, req: GenerateRequest, ids: list[int]) -> SamplingParams:
        """The prompt's checks (its sampling was checked where it entered the engine)."""
        sp = req.sampling
        if not ids:
            raise RequestError("the prompt is empty")
        limit = self.max_model_len
        if limit and len(ids) + sp.max_new_tokens > limit:
            room = limit - len(ids)
            if sp.fit_context and room >= max(1, sp.min_new_tokens):
                return msgspec.structs.replace(sp, max_new_tokens=room)  # our default, fit
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the request has "
                f"{len(ids)} prompt tokens and asks for {sp.max_new_tokens} new tokens "
                f"({len(ids) + sp.max_new_tokens} in total)",
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            )
        return sp

    async def _fail(
        self,
        to: str,
        rid: str,
        message: str,
        code: ErrorCode | None,
        *,
        reason: FinishReason = FinishReason.ERROR,
        prompt_tokens: int = 0,
    ) -> None:
        delta = TextDelta(
            rid=rid,
            finish_reason=reason,
            error=message or None,
            error_code=code,
            usage=Usage(prompt_tokens, 0, 0),
        )
        try:
            await self.send(to, TextBatch(items=[delta]))
        except ActorError as exc:
            log.warning("cannot tell %s that %s failed: %s", to, rid, exc)

    @handles(AbortRequest)
    async def on_abort(self, msg: AbortRequest, env: Envelope) -> None:
        if msg.rid in self.tokenizing:
            self.tokenizing.discard(msg.rid)
        elif msg.rid in self.live:
            await self.send(self.live[msg.rid].scheduler, msg)

    # -- tokens back ----------------------------------------------------------
    @handles(TokenBatch)
    async def on_tokens(self, msg: TokenBatch, env: Envelope) -> None:
        items = [d for d in msg.items if d.rid in self.live]
        if not items:
            return
        lives = [self.live[d.rid] for d in items]
        texts = stream_batch(
            [lv.stream for lv in lives],
            [d.token_ids for d in items],
            [d.finish_reason for d in items],
        )
        batches: dict[str, list[TextDelta]] = {}
        for delta, lv, text in zip(items, lives, texts, strict=True):
            lv.completion_tokens += len(delta.token_ids)
            lv.cached_tokens = max(lv.cached_tokens, delta.cached_tokens)
            reason = text.finish_reason or delta.finish_reason
            thought, content = lv.split(text.text, reason is not None)
            out = TextDelta(
                rid=delta.rid,
                text=content,
                reasoning_text=thought,
                grammar_backend=delta.grammar_backend,
                token_ids=delta.token_ids,
                logprobs=token_logprobs(
                    self.tok, delta.token_ids, delta.logprobs, delta.top_logprobs
                )
                if lv.logprobs
                else None,
                finish_reason=reason,
                matched_stop=text.matched_stop,
                usage=Usage(lv.prompt_tokens, lv.completion_tokens, lv.cached_tokens)
                if reason
                else None,
                error=delta.error,
                error_code=delta.error_code,
            )
            batches.setdefault(lv.reply_to, []).append(out)
            if reason is not None:
                self._forget(delta.rid)
                if text.stop_string_hit and delta.finish_reason is None:
                    await self.send(lv.scheduler, FinishRequest(rid=delta.rid))
        for to, deltas in batches.items():
            try:
                await self.send(to, TextBatch(items=deltas))
            except ActorError as exc:
                log.warning("cannot deliver to %s: %s", to, exc)

    def _forget(self, rid: str) -> _Live | None:
        """``rid`` is done here: its books go (and its replica's load with it)."""
        live = self.live.pop(rid, None)
        if live is not None:
            self.sent.pop(live.msg_id, None)
        if self.router is not None:
            self.router.finish(rid)
        return live

    @handles(CacheEvents)
    async def on_cache_events(self, msg: CacheEvents, env: Envelope) -> None:
        if self.router is not None:
            self.router.on_events(env.sender, msg)

    @handles(DrainReplica)
    async def on_drain_replica(self, msg: DrainReplica, env: Envelope) -> Info:
        """Take a replica out of routing (or back): its load says when it is drained."""
        try:
            if self.router is None:
                raise ValueError("there is one replica (--dp-size 1): drain the server with /drain")
            load = self.router.drain(msg.replica, msg.drain)
        except ValueError as exc:
            raise ActorError(str(exc), code=CallErrorCode.INVALID_REQUEST, status=400) from None
        log.info(
            "replica %d %s (%d in flight)", msg.replica, "draining" if msg.drain else "back", load
        )
        return Info(role=self.role, values={"load": load})

    # -- failures -------------------------------------------------------------
    async def on_error(self, env: Envelope, error: ErrorReply) -> None:
        rid = self.sent.pop(env.reply_to, None)
        live = self._forget(rid) if rid else None
        if live is not None and rid is not None:
            await self._fail(live.reply_to, rid, error.message, code_for_status(error.status))

    async def on_peer_up(self, role: str) -> None:
        if self.router is not None:
            self.router.member_up(role)

    async def on_peer_down(self, role: str, reason: str) -> None:
        if self.router is not None and base_role(role) in REPLICA_ROLES:
            for rid in self.router.member_down(role):  # what that replica's scheduler held
                live = self._forget(rid)
                if live is not None:
                    why = f"the {role} actor died ({reason})"
                    await self._fail(live.reply_to, rid, why, ErrorCode.UNAVAILABLE)
            return
        if role != "scheduler":
            # A client is gone: nobody reads its outputs, so stop computing them.
            orphans = [rid for rid, live in self.live.items() if live.reply_to == role]
            for rid in orphans:
                live = self.live[rid]
                self._forget(rid)
                try:
                    await self.send(
                        live.scheduler, AbortRequest(rid=rid, reason=FinishReason.ABORT)
                    )
                except ActorError as exc:
                    log.warning("cannot abort %s: %s", rid, exc)
            return
        for rid, live in list(self.live.items()):
            await self._fail(
                live.reply_to, rid, f"the scheduler died ({reason})", ErrorCode.UNAVAILABLE
            )
        self.live.clear()
