"""SchedulerActor: a thin shell over :class:`~actorlm.actors.policy.BatchPlanner`.

Its loop runs one step at a time: at most one exchange with the cache manager
(every page operation of the step in one ``CacheStep``), then exactly one with
the worker (``ForwardBatch`` → ``StepResult``), then one ``TokenBatch`` per
tokenizer. Requests, aborts and stop-string finishes arrive between steps.

It decides when the KV pool is lost: when the worker or the cache manager goes
down or comes back as a new incarnation, the requests running on it fail (or,
with ``on_worker_loss=recompute``, go back to the queue to be computed again from
their tokens), and the pool epoch it sends with every ``CacheStep`` goes up, so the
cache manager forgets every page mapping before it admits anything again. Nothing
is ever served from KV that no longer exists, whoever noticed the death first.

With LoRA a request naming an adapter first gets a reference from the lora_loader
(``adapters.AdapterGate``; one ``LoraStep`` exchange in the steps where something
changed), then waits in the queue until its adapter is in a worker slot. When the
loader dies, every request holding a reference ends with a 503: its successor knows
none of them.

With prefill replicas (``--prefill-replicas``, ``messages/kv.py``) a decode replica's
scheduler hands a long fresh prompt, once admitted here, to a prefill replica's
scheduler (the least busy one up), after telling its own worker which pages to expect.
The prefill worker ships the pages to ours, which says so (``KVArrived``); the request
then decodes here. A prefill replica's error, a member of it going down, or no KV by
``--kv-transfer-timeout-s`` ends the request at once and its pages come back. A prefill
replica's scheduler is a plain scheduler: the requests it gets name their ``kv_dest``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from ...messages.base import Message
from ...messages.cache import CacheStepResult
from ...messages.envelope import Envelope
from ...messages.errors import ErrorCode, code_for_status
from ...messages.generate import (
    AbortRequest,
    FinishReason,
    FinishRequest,
    TokenBatch,
    TokenDelta,
    TokenizedRequest,
)
from ...messages.grammar import CompileGrammar, GrammarCompiled
from ...messages.kv import ExpectKV, KVArrived, KVDest
from ...messages.lora import LoraSlotsChanged, LoraStepResult
from ...messages.step import ForwardBatch, StepResult
from ..replicas import is_prefill_role, peer_of, prefill_schedulers, replica_index
from ..runtime import Actor, ActorError, handles
from .adapters import AdapterGate
from .batch_log import BatchLog, is_prompt
from .policy import BatchPlanner, Refusal, Req
from .streaming import StreamBuffer

__all__ = ["SchedulerActor"]

log = logging.getLogger(__name__)

# With overlap, the step after one with prompt tokens is planned only once that one is
# back when such steps take this long (see SchedulerActor._plans_ahead).
LONG_PROMPT_STEP_MS = 20.0


@dataclass(frozen=True)
class _Remote:
    target: str  # the prefill scheduler computing the prompt
    deadline: float  # monotonic: its KV must have arrived by then


class SchedulerActor(Actor):
    role = "scheduler"

    async def on_start(self) -> None:
        model = self.config.model
        if model.num_pages <= 0 or model.max_model_len <= 0:
            raise ValueError(
                "the scheduler needs model.num_pages and max_model_len (resolve the config first)"
            )
        self.planner = BatchPlanner(
            self.config.scheduler,
            page_size=model.page_size,
            num_pages=model.num_pages,
            max_model_len=model.max_model_len,
            prefix_cache=self.config.cache.enable_prefix_cache,
        )
        self.reply_to: dict[str, str] = {}  # rid → tokenizer role that owns it
        self._wake = asyncio.Event()
        self._step_id = 0
        # Bumped whenever the pool's contents are lost: our incarnation makes a restarted
        # scheduler's epochs differ from its predecessor's too.
        self.pool_epoch = (self.runtime.incarnation & (2**40 - 1)) << 20
        cfg = self.config
        self.max_queue_time = cfg.scheduler.max_queue_time_s or cfg.deploy.request_timeout_s
        self.overlap = not cfg.scheduler.disable_overlap_schedule
        # the worker's time for the last step with prompt tokens (none yet: long)
        self.prompt_step_ms = math.inf
        self.streaming = StreamBuffer(cfg.scheduler.stream_interval)
        capacity = model.num_pages * model.page_size
        self.batch_log = BatchLog(cfg.scheduler.decode_log_interval, capacity)
        self.gate = AdapterGate() if cfg.lora.enabled else None
        decode = replica_index(self.role) < cfg.router.dp_size
        self.prefill = prefill_schedulers(cfg.router) if decode else []
        self.remote_at: dict[str, _Remote] = {}  # rid → where its prompt is computed
        self.spawn(self._loop(), name="scheduler-loop")
        if self.prefill:
            self.spawn(self._remote_watchdog(), name="remote-prefill-watchdog")

    # This replica's partners (``actors.replicas``): scheduler.1 steps worker.1 alone.
    @property
    def worker(self) -> str:
        return peer_of(self.role, "worker")

    @property
    def cache_manager(self) -> str:
        return peer_of(self.role, "cache_manager")

    @property
    def pool_roles(self) -> set[str]:
        return {self.worker, self.cache_manager}

    def stats(self) -> dict[str, Any]:
        lora = {}
        if self.gate is not None:
            lora = {"lora_acquiring": len(self.gate.pending) + len(self.gate.sent)}
            lora["lora_requests"] = len(self.gate.held)
        return {
            "running": len(self.planner.running),
            "queued": len(self.planner.waiting),
            "compiling": len(self.planner.compiling),
            "pd_remote_in_flight": len(self.planner.remote),
            **self.planner.stats,
            **lora,
        }

    # -- inbox ----------------------------------------------------------------
    @handles(TokenizedRequest)
    async def on_request(self, msg: TokenizedRequest, env: Envelope) -> None:
        self.reply_to[msg.rid] = env.sender
        if msg.lora_path and not msg.lora_id:
            if self.gate is None:
                why = (
                    f"no LoRA adapter named {msg.lora_path!r}: this server serves none "
                    "(start it with --enable-lora or --lora-paths)"
                )
                await self._emit([self._error(msg, why, ErrorCode.NOT_FOUND)])
                return
            self.gate.add(msg, env.sender)  # it joins the queue once it holds a reference
            self._wake.set()
            return
        await self._add(msg, env.sender)

    async def _add(self, msg: TokenizedRequest, sender: str) -> None:
        refused = self.planner.add(msg, sender)
        if refused is None and self.pool_roles & self.runtime.down:
            self.planner.abort(msg.rid, notify=False)
            refused = Refusal(
                "the engine is restarting a failed actor; try again shortly",
                ErrorCode.UNAVAILABLE,
            )
        if refused is not None:
            await self._emit([self._error(msg, refused.message, refused.code)])
            return
        if msg.rid in self.planner.compiling:
            constraint = msg.sampling.constraint
            assert constraint is not None
            self.spawn(self._compile(msg.rid, *constraint), name=f"compile-{msg.rid}")
            return
        self._wake.set()

    async def _compile(self, rid: str, kind: str, value: str) -> None:
        """Ask the worker to compile ``rid``'s constraint; the request joins the queue
        when it is ready, or ends alone when it cannot be. Nothing else waits for it."""
        # The worker answers by the compile timeout; this bound only covers a lost worker.
        timeout = (
            self.config.grammar.grammar_compile_timeout_s + self.config.deploy.request_timeout_s
        )
        try:
            reply = await self.request(
                self.worker, CompileGrammar(rid=rid, kind=kind, value=value), timeout=timeout
            )
        except ActorError as exc:
            self.planner.grammar_failed(
                rid, f"the grammar could not be compiled: {exc}", code_for_status(exc.status)
            )
        else:
            assert isinstance(reply, GrammarCompiled)
            if reply.error:
                self.planner.grammar_failed(rid, reply.error, reply.code)
            else:
                self.planner.grammar_ready(rid, reply.backend)
        self._wake.set()

    @staticmethod
    def _error(msg: TokenizedRequest, message: str, code: ErrorCode) -> TokenDelta:
        return TokenDelta(
            rid=msg.rid,
            finish_reason=FinishReason.ERROR,
            prompt_tokens=len(msg.input_ids),
            error=message,
            error_code=code,
        )

    @handles(AbortRequest)
    async def on_abort(self, msg: AbortRequest, env: Envelope) -> None:
        remote = self.remote_at.pop(msg.rid, None)
        if remote is not None:  # it stops there too
            with contextlib.suppress(ActorError):
                await self.send(remote.target, AbortRequest(rid=msg.rid, reason=msg.reason))
        waiting = self.gate.abort(msg.rid) if self.gate is not None else None
        if waiting is not None:
            req = waiting[0]
            delta = TokenDelta(
                rid=msg.rid, finish_reason=msg.reason, prompt_tokens=len(req.input_ids)
            )
            await self._emit([delta])
        elif self.planner.abort(msg.rid, msg.reason):
            self._wake.set()

    # -- prefill/decode disaggregation -----------------------------------------------
    def _prefill_targets(self) -> dict[str, int]:
        """Each prefill scheduler whose replica is whole → the prompts it may take now
        (``--max-prefill-queue`` less those it holds of ours; 0: no limit)."""
        down = self.runtime.down
        busy = [r.target for r in self.remote_at.values()]
        cap = self.config.router.max_prefill_queue or 1 << 30
        return {
            p: max(0, cap - busy.count(p))
            for p in self.prefill
            if not {p, peer_of(p, "worker"), peer_of(p, "cache_manager")} & down
        }

    async def _remote_prefill(self, req: Req, target: str) -> None:
        """Have ``target`` compute ``req``'s prompt into the pages admitted for it here."""
        rid, cfg = req.rid, self.config
        start = req.computed // cfg.model.page_size  # the cached prefix ends on a page
        dest = req.pages[start : self.planner.pages_for(req.prompt_len)]
        if self.planner.remote.get(rid) is not req:
            return  # ended before this task ran
        try:
            await self.request(self.worker, ExpectKV(rid=rid, page_ids=dest))
            if self.planner.remote.get(rid) is not req:  # ended meanwhile: its release may
                self.planner.release_worker(rid)  # have gone before the worker expected it
                return
            sampling = msgspec.structs.replace(req.params, max_new_tokens=1)
            kv_dest = KVDest(self.worker, dest, start)
            await self.send(
                target, msgspec.structs.replace(req.request, sampling=sampling, kv_dest=kv_dest)
            )
        except ActorError as exc:
            await self._remote_failed(rid, f"the prefill could not be started: {exc}")

    async def _remote_watchdog(self) -> None:
        """Ends remote prefills past their deadline, and forgets (and stops) those whose
        request ended here some other way (a lost pool, a failed cache step)."""
        limit = self.config.router.kv_transfer_timeout_s
        while True:
            await asyncio.sleep(min(0.5, limit))
            now = time.monotonic()
            for rid, remote in list(self.remote_at.items()):
                if rid not in self.planner.remote:
                    await self._remote_failed(rid, "", abort=True)  # already ended
                elif now > remote.deadline:
                    why = f"the prompt's KV did not arrive within {limit:g}s (--kv-transfer-timeout-s)"
                    await self._remote_failed(rid, why, abort=True)

    async def _remote_failed(
        self, rid: str, why: str, code: ErrorCode = ErrorCode.UNAVAILABLE, *, abort: bool = False
    ) -> None:
        remote = self.remote_at.pop(rid, None)
        if self.planner.remote_failed(rid, why, code):
            log.warning("remote prefill of %s failed: %s", rid, why)
            self._wake.set()
        if abort and remote is not None:
            with contextlib.suppress(ActorError):
                await self.send(remote.target, AbortRequest(rid=rid))

    @handles(KVArrived)
    async def on_kv_arrived(self, msg: KVArrived, env: Envelope) -> None:
        if env.sender != self.worker:
            raise PermissionError(f"{env.sender} is not this scheduler's worker")
        if msg.error:
            await self._remote_failed(msg.rid, msg.error, ErrorCode.INTERNAL, abort=True)
            return
        self.remote_at.pop(msg.rid, None)
        if self.planner.remote_done(msg.rid, msg.token_id, msg.logprob, msg.top_logprobs):
            self._wake.set()

    @handles(TokenBatch)
    async def on_prefill_deltas(self, msg: TokenBatch, env: Envelope) -> None:
        """A prefill replica's outputs: only its errors matter here (its token comes
        with the KV)."""
        for delta in msg.items:
            remote = self.remote_at.get(delta.rid)
            if delta.error and remote is not None and remote.target == env.sender:
                why = f"the prefill replica failed: {delta.error}"
                await self._remote_failed(delta.rid, why, delta.error_code or ErrorCode.INTERNAL)

    @handles(FinishRequest)
    async def on_finish(self, msg: FinishRequest, env: Envelope) -> None:
        # A stop string matched: the tokenizer has already ended the client's stream.
        if self.planner.abort(msg.rid, msg.reason, notify=False):
            self.reply_to.pop(msg.rid, None)
            self.streaming.forget(msg.rid)
            self._wake.set()

    @handles(LoraSlotsChanged)
    async def on_slots_changed(self, msg: LoraSlotsChanged, env: Envelope) -> None:
        if self.gate is not None:
            self.gate.dirty = True
            self._wake.set()

    async def on_peer_down(self, role: str, reason: str) -> None:
        if role == "lora_loader" and self.gate is not None:
            await self._adapters_lost(f"the lora_loader actor died ({reason})")
            return
        if role in self.pool_roles:
            if self.gate is not None:  # its slots are gone: none is ready until reloaded
                self.planner.ready_adapters = self.gate.ready = set()
                self.gate.dirty = True
            self.pool_epoch += 1
            self.planner.pool_lost()
            if self.config.scheduler.on_worker_loss == "recompute":
                log.warning("%s lost (%s): recomputing running requests", role, reason)
                self.planner.requeue_running()
            else:
                self.planner.fail_all(f"the {role} actor died ({reason})", ErrorCode.UNAVAILABLE)
            self._wake.set()
            return
        if is_prefill_role(role, self.config.router):
            lost = replica_index(role)
            for rid, remote in list(self.remote_at.items()):
                if replica_index(remote.target) == lost:
                    await self._remote_failed(rid, f"the prefill replica's {role} died ({reason})")
            return
        # A tokenizer (or a client it forwards for) is gone: nobody reads those outputs.
        orphans = [rid for rid, owner in self.reply_to.items() if owner == role]
        for rid in orphans:
            self.planner.abort(rid, notify=False)
            if self.gate is not None:
                self.gate.abort(rid)
            del self.reply_to[rid]
            self.streaming.forget(rid)
        if orphans:
            log.warning("%s went down: aborted its %d request(s)", role, len(orphans))
            self._wake.set()

    async def on_peer_up(self, role: str) -> None:
        if role in self.pool_roles or role == "lora_loader":
            if self.gate is not None:
                self.gate.dirty = True
            self._wake.set()  # requeued requests can run again

    async def _adapters_lost(self, why: str) -> None:
        """The loader died: the requests holding its references end (503); base ones go on."""
        assert self.gate is not None
        waiting, held = self.gate.reset()
        self.planner.ready_adapters = set()
        deltas = [self._error(msg, why, ErrorCode.UNAVAILABLE) for msg, _ in waiting]
        for rid in held:
            req = self.planner.running.get(rid) or self.planner.waiting.get(rid)
            if req is not None and self.planner.abort(rid, notify=False):
                deltas.append(self._error(req.request, why, ErrorCode.UNAVAILABLE))
        if deltas:
            log.warning("%s: %d request(s) with adapters end", why, len(deltas))
        await self._emit(deltas)
        self._wake.set()

    async def _lora_round(self) -> None:
        """At most one LoraStep: references to take and drop, slots wanted and in use."""
        gate, planner = self.gate, self.planner
        assert gate is not None
        # a zombie's step in flight still reads its adapter's slot: it stays in use
        gate.sweep(
            lambda rid: rid in planner.running or rid in planner.waiting or planner.is_zombie(rid)
        )
        step = gate.step(planner.waiting.values(), [*planner.running.values(), *planner.zombies()])
        if step is None:
            return
        try:
            result = await self.request("lora_loader", step)
        except ActorError as exc:
            log.error("LoRA step failed: %s", exc)
            why = f"the lora_loader could not be reached: {exc}"
            code = code_for_status(exc.status)
            await self._emit([self._error(m, why, code) for m, _ in gate.failed()])
            return
        assert isinstance(result, LoraStepResult)
        known = result.worker_incarnation in (0, self.runtime.peer_incarnation(self.worker))
        acquired, refused = gate.apply(result, worker_known=known)
        planner.ready_adapters = gate.ready
        await self._emit([self._error(m, no.message, no.code) for (m, _), no in refused])
        for msg, reply_to in acquired:
            await self._add(msg, reply_to)

    def _lora_pending(self) -> bool:
        gate = self.gate
        return gate is not None and bool(gate.pending or gate.releases or gate.dirty)

    def _pool_down(self) -> bool:
        return bool(self.pool_roles & self.runtime.down)

    # -- the loop ---------------------------------------------------------------
    async def _emit(self, deltas: list[TokenDelta]) -> None:
        deltas = self.streaming.take(deltas)
        if not deltas:
            return
        by_dest: dict[str, list[TokenDelta]] = {}
        for d in deltas:
            dest = self.reply_to.get(d.rid, "tokenizer")
            by_dest.setdefault(dest, []).append(d)
            if d.finish_reason is not None:
                self.reply_to.pop(d.rid, None)
        for dest, items in by_dest.items():
            try:
                await self.send(dest, TokenBatch(items=items))
            except ActorError as exc:
                log.warning("cannot deliver tokens to %s: %s", dest, exc)

    async def _loop(self) -> None:
        planner = self.planner
        while True:
            # Cleared before looking, so a request or abort that lands while we step
            # (its handler sets the event) is never slept through.
            self._wake.clear()
            if planner.waiting:
                planner.expire_waiting(self.max_queue_time)
            if self.gate is not None:
                await self._lora_round()
            await self._emit(planner.take_deltas())
            if not (planner.has_work() or self._lora_pending()) or self._pool_down():
                await self._idle()
                continue
            if not await self._step():
                # Nothing could run (no pages, everything blocked): wait for a change.
                await self._idle()

    async def _idle(self) -> None:
        """Wait for a change; with requests queued, not past the next queue deadline check."""
        if not self.planner.waiting:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), min(1.0, self.max_queue_time))

    def _forward(self, batch: ForwardBatch) -> asyncio.Task[Message]:
        timeout = self.config.scheduler.step_timeout_s
        return asyncio.create_task(self.request(self.worker, batch, timeout=timeout))

    def _next_batch(self) -> ForwardBatch:
        self._step_id += 1
        planner = self.planner
        batch = planner.build_batch(self._step_id)
        if self.gate is not None and self.gate.held and batch.seqs:
            lora_ids = [planner.running[s.rid].request.lora_id for s in batch.seqs]
            if any(lora_ids):
                batch = msgspec.structs.replace(batch, lora_ids=lora_ids)
        return batch

    async def _step(self) -> bool:
        """Steps until the batch runs dry. With overlap, the next step is planned and sent
        while the worker computes this one, so it goes straight from one to the next."""
        changed = await self._cache_step()
        batch = self._next_batch()
        if not batch.seqs:
            return changed
        planner = self.planner
        flight: tuple[ForwardBatch, asyncio.Task[Message]] | None = (batch, self._forward(batch))
        finished: list[TokenDelta] = []  # told only once their pages are back
        while flight is not None:
            batch, task = flight
            flight = None
            prompts = any(map(is_prompt, batch.seqs))
            if self._plans_ahead(prompts):
                if self.gate is not None:
                    await self._lora_round()  # adapters wanted now, while the worker runs
                await self._cache_step()  # this step's finishes, the next step's pages
                await self._emit(finished)
                finished = []
                ahead = self._next_batch()
                if ahead.seqs:
                    flight = (ahead, self._forward(ahead))
            try:
                reply = await task
            except ActorError as exc:
                log.error("forward step failed: %s", exc)
                planner.fail_batch(
                    batch, f"the forward pass failed: {exc}", code_for_status(exc.status)
                )
                continue  # a step still in flight gets its own answer, or error
            assert isinstance(reply, StepResult)
            if reply.forward_ms > 0.0 and prompts:
                self.prompt_step_ms = reply.forward_ms
            deltas = planner.on_result(batch, reply)
            running = planner.running.values()
            self.batch_log.step(
                batch, reply, (r.computed for r in running), len(running), len(planner.waiting)
            )
            await self._emit([d for d in deltas if d.finish_reason is None])
            finished += [d for d in deltas if d.finish_reason is not None]
            if flight is None and finished:
                # The pages of finished requests go back before their clients hear they
                # are done, so whatever a client does next (a cache flush, the same
                # prompt again) sees them released: the next cache round, run early.
                if planner.has_finishes():
                    await self._cache_step()
                await self._emit(finished)
                finished = []
        if finished:  # the last step failed
            await self._cache_step()
            await self._emit(finished)
        return True

    def _plans_ahead(self, prompts: bool) -> bool:
        """Whether to plan the next step while the worker runs this one (overlap). Not
        while it runs prompt tokens (``prompts``), where such steps take LONG_PROMPT_STEP_MS or more (a
        CPU's prefill chunks take tens of ms): planning ahead would save the worker a few
        percent of the step, while every request arriving during it, a closed loop's next
        one or a burst's rest, would wait a whole step more for its first token. 2-core
        AMX Xeon, bench/serving.py against planning ahead always, alternated 4 times on
        fresh servers: shared-prefix TTFT p50 204 -> 164 ms at c=4 and 185 -> 154 ms at
        c=16 (c=16 487 -> 514 out tok/s); random c=1 / 8 / 32 level."""
        if not self.overlap or self._pool_down():
            return False
        return not prompts or self.prompt_step_ms < LONG_PROMPT_STEP_MS

    async def _cache_step(self) -> bool:
        """Send the planner's pending cache operations; whether anything changed."""
        planner = self.planner
        ops = planner.cache_ops()
        if ops is None:
            return False
        ops = msgspec.structs.replace(ops, pool_epoch=self.pool_epoch)
        room = self._prefill_targets() if ops.admits and self.prefill else {}
        planner.remote_slots = sum(room.values())
        planner.remote_threshold = self.config.router.max_local_prefill_tokens if room else None
        try:
            result = await self.request(self.cache_manager, ops)
        except ActorError as exc:
            log.error("cache step failed: %s", exc)
            planner.fail_all(f"the cache manager failed: {exc}", code_for_status(exc.status))
            return True
        assert isinstance(result, CacheStepResult)
        planner.apply_cache(result)
        deadline = time.monotonic() + self.config.router.kv_transfer_timeout_s
        for req in planner.take_remote():
            target = max(room, key=room.__getitem__)  # the one with the most room
            room[target] -= 1
            self.remote_at[req.rid] = _Remote(target, deadline)
            self.spawn(self._remote_prefill(req, target), name=f"prefill-{req.rid}")
        return bool(result.admitted or ops.finishes or ops.releases or ops.commits)
