"""WorkerActor: one ForwardBatch in, one StepResult out, the forward pass off the loop.

The model, its KV tensors, the attention backend and the sampler all live in
:class:`~actorlm.gpu.runner.ModelRunner`; this actor only moves messages. It also
answers ``CompileGrammar``: constraints compile here, in the grammar manager's
threads, concurrently with the forward pass (see ``actorlm.gpu.grammar.manager``).

With LoRA enabled it also holds the adapter slots: ``LoadLoraSlot`` from the
lora_loader copies an adapter's weights into one, off the loop and beside the forward
pass in flight (the loader only hands out slots no running request uses). When the
loader goes down its slots are emptied: the adapters in them are no longer known.

With prefill/decode disaggregation (``messages/kv.py``) a prefill replica's worker sends
a prompt's pages to a decode worker right after the pass that computed them, and a
decode worker writes the pages it was told to expect (``kv_transfer``), then tells its
scheduler. Pages are taken only from another worker's key.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ...config import DEFAULT_MAX_LORA_RANK
from ...messages.control import Ack, GetInfo, Info
from ...messages.envelope import Envelope
from ...messages.errors import ErrorCode
from ...messages.grammar import CompileGrammar, GrammarCompiled
from ...messages.kv import ExpectKV, KVArrived, KVPages
from ...messages.lora import LoadLoraSlot
from ...messages.step import ForwardBatch, PageIO, SeqError, StepResult
from ..replicas import base_role, parse_cpus, peer_of, replica_index
from ..runtime import RESTARTED, Actor, ActorError, handles
from .kv_transfer import Expected, pages_to_ship, write_pages
from .serial import SerialThread

if TYPE_CHECKING:
    from ...gpu.grammar.manager import GrammarSetup

__all__ = ["WorkerActor"]

log = logging.getLogger(__name__)


class WorkerActor(Actor):
    role = "worker"

    async def on_start(self) -> None:
        from ...gpu.grammar.manager import GrammarManager
        from ...gpu.runner import ModelRunner
        from ..cache.actor import open_storage

        cpus = self.config.deploy.worker_cpus
        if cpus:  # before the runner sizes its threads by the CPUs this process may use
            os.sched_setaffinity(0, parse_cpus(cpus[replica_index(self.role) % len(cpus)]))
        self.runner = await self.run_blocking(ModelRunner, self.config.model)
        self.grammars = GrammarManager(self.config.grammar, self._grammar_setup)
        self.runner.grammars = self.grammars
        self.compiles = 0
        lora = self.config.lora
        if lora.enabled:
            rank = lora.max_lora_rank or DEFAULT_MAX_LORA_RANK
            await self.run_blocking(self.runner.enable_lora, lora.max_loras_per_batch, rank)
        self.storage = open_storage(self.config)
        # One job on the runner at a time, in arrival order: its KV pool and sampler
        # state are not shared-safe.
        self._serial = SerialThread(f"{self.role}-steps")
        self._lora_lock = asyncio.Lock()  # one slot load at a time (and none while clearing)
        self.lora_loads = 0
        self.steps = 0
        self.forward_ms = 0.0
        self.kv_expected = Expected()
        self.kv = {"kv_sent_bytes": 0, "kv_received_bytes": 0, "kv_dropped": 0}
        # The model's objects (modules, weights, their kernels' descriptors) live as long
        # as the process: frozen, the cyclic collector that a step's allocations set off
        # stops walking them (a 512-token prefill of the default model, 2-core Xeon:
        # 97.5 -> 90-92 ms, ~3 ms a pass of collections)
        gc.freeze()

    def ready_info(self) -> dict[str, Any]:
        from ...gpu.platforms import device_platform

        platform = device_platform(self.runner.cfg.device)
        return {**msgspec.to_builtins(self.runner.info), "platform": platform.describe()}

    async def on_stop(self) -> None:
        serial = getattr(self, "_serial", None)
        if serial is not None:
            serial.close()
        grammars = getattr(self, "grammars", None)  # None: on_start was interrupted first
        if grammars is not None:
            grammars.close()
        gc.unfreeze()  # what on_start froze can be collected at exit again

    def stats(self) -> dict[str, Any]:
        corrupt = getattr(self.storage, "corrupt", 0)
        return {
            "steps": self.steps,
            "forward_ms_total": self.forward_ms,
            "storage_corrupt": corrupt,
            "grammar_compiles": self.compiles,
            "lora_slot_loads": self.lora_loads,
            **self.kv,
            "kv_expected": len(self.kv_expected),
        }

    def _grammar_setup(self) -> GrammarSetup:
        """The model's tokenizer for the grammar backends, and the think tokens of
        ``--reasoning-parser``; run once, in a compile thread, on the first constraint."""
        from ...extensions.points import REASONING_PARSERS
        from ...gpu.grammar.base import GrammarContext
        from ...gpu.grammar.manager import GrammarSetup
        from ...gpu.grammar.reasoner import ThinkTokens
        from ..tokenizer import reasoning  # noqa: F401  (registers the built-in formats)
        from ..tokenizer.tokenization import load_tokenizer

        cfg = self.config.grammar
        tok = load_tokenizer(self.config.model.path)
        if not getattr(tok.hf, "is_fast", False):
            raise ValueError("the grammar backends need a fast (tokenizers) tokenizer")
        context = GrammarContext(
            tokenizer=tok.hf,
            vocab_size=self.runner.info.vocab_size,
            eos_token_ids=tuple(sorted(tok.eos_token_ids)),
            any_whitespace=cfg.grammar_any_whitespace,
        )
        think = None
        if cfg.reasoning_parser:
            fmt = REASONING_PARSERS.get(cfg.reasoning_parser)
            start = tok.encode(fmt.think_start, add_special_tokens=False)
            end = tok.encode(fmt.think_end, add_special_tokens=False)
            if len(start) == 1 and len(end) == 1:
                think = ThinkTokens(start[0], end[0], fmt.forced)
            else:
                log.warning(
                    "--reasoning-parser %s: %s and %s are not single tokens of this tokenizer; "
                    "constraints apply from the first output token",
                    fmt.name,
                    fmt.think_start,
                    fmt.think_end,
                )
        return GrammarSetup(context, think)

    def _step(self, batch: ForwardBatch) -> tuple[StepResult, list[tuple[str, KVPages]]]:
        self.kv_expected.drop(batch.release)  # ended: a late transfer writes nothing now
        result = self._forward(batch)
        if not any(s.ship for s in batch.seqs):
            return result, []
        sampled = {r.rid: r for r in result.results}
        pool = self.runner.pool
        ships = [
            (s.ship.worker, msg)
            for s in batch.seqs
            if s.ship is not None and s.rid in sampled
            for msg in pages_to_ship(pool, s, sampled[s.rid])
        ]
        return result, ships

    def _forward(self, batch: ForwardBatch) -> StepResult:
        if not (batch.store_pages or batch.load_pages):
            return self.runner.forward(batch)
        lost = self._move_pages(batch)
        if not lost:
            return self.runner.forward(batch)
        # A page storage could not give back: the sequences that needed it end (their
        # client may retry, and the prefix is then computed), the rest of the step runs.
        lost_ids = {io.page_id for io in lost}
        hit = [s for s in batch.seqs if lost_ids.intersection(s.page_ids)]
        keep = [s for s in batch.seqs if s not in hit]
        result = self.runner.forward(msgspec.structs.replace(batch, seqs=keep))
        message = "a cached KV page could not be read back from storage; retry the request"
        errors = [SeqError(s.rid, message, ErrorCode.UNAVAILABLE) for s in hit]
        return msgspec.structs.replace(
            result, errors=[*result.errors, *errors], lost_keys=[io.key for io in lost]
        )

    def _move_pages(self, batch: ForwardBatch) -> list[PageIO]:
        """HiCache: save pages to storage, then load pages from it (see CacheManagerActor).
        Returns the loads storage could not serve whole (missing, or damaged and dropped)."""
        if self.storage is None:
            raise RuntimeError("page moves asked of a worker without HiCache storage")
        pool = self.runner.pool
        for io in batch.store_pages:
            self.storage.set(io.key, pool.read_pages_numpy([io.page_id]).tobytes())
        if not batch.load_pages:
            return []
        shape = pool.read_pages_numpy([0]).shape
        dtype = pool.read_pages_numpy([0]).dtype
        lost = []
        for io in batch.load_pages:
            blob = self.storage.get(io.key)
            if blob is None or len(blob) != int(np.prod(shape)) * dtype.itemsize:
                log.warning("HiCache page %s… is missing or damaged: a miss", io.key[:12])
                lost.append(io)
                continue
            pool.write_pages_numpy(
                [io.page_id], np.frombuffer(blob, dtype=dtype).reshape(shape).copy()
            )
        return lost

    async def on_peer_down(self, role: str, reason: str) -> None:
        if role == peer_of(self.role, "scheduler") and reason == RESTARTED:
            # Its requests died with it: their sampling state here is garbage.
            await self._serial.submit(self._release_all)
        if role == "lora_loader" and self.runner.lora is not None:
            # A step planned already keeps its slots; none planned from now on finds one.
            async with self._lora_lock:
                self.runner.lora.clear()

    def _release_all(self) -> None:
        self.runner.release_all()
        self.grammars.release_all()
        self.kv_expected.clear()

    @handles(LoadLoraSlot)
    async def on_load_slot(self, msg: LoadLoraSlot, env: Envelope) -> None:
        pool = self.runner.lora
        if pool is None:
            raise ValueError("this worker has no LoRA slots (start it with --enable-lora)")
        targets = [(t.module, t.a, t.b) for t in msg.targets]
        async with self._lora_lock:
            await self.run_blocking(
                lambda: pool.load(msg.slot, msg.lora_id, targets, first=msg.first, last=msg.last)
            )
        self.lora_loads += int(msg.last)

    @handles(GetInfo)
    async def on_info(self, msg: GetInfo, env: Envelope) -> Info:
        return Info(role=self.role, values=self.ready_info())

    @handles(ForwardBatch)
    async def on_forward(self, msg: ForwardBatch, env: Envelope) -> StepResult:
        result, ships = await self._serial.submit(lambda: self._step(msg))
        if len(msg.seqs) > len(result.errors):  # a forward pass ran
            self.steps += 1
        self.forward_ms += result.forward_ms
        for dest, pages in ships:  # read out of the pool already: it may reuse them
            try:
                await self.send(dest, pages)
            except ActorError as exc:  # its decode scheduler fails the request by itself
                log.warning("cannot ship the KV of %s to %s: %s", pages.rid, dest, exc)
                continue
            self.kv["kv_sent_bytes"] += pages.kv.nbytes
        return result

    # -- prefill/decode disaggregation: the decode side ---------------------------
    @handles(ExpectKV)
    async def on_expect_kv(self, msg: ExpectKV, env: Envelope) -> Ack:
        if env.sender != peer_of(self.role, "scheduler"):
            raise PermissionError(f"{env.sender} is not this worker's scheduler")
        # No lock: nothing writes these pages before they are expected, and the release
        # that ends the expectation comes in a later ForwardBatch.
        self.kv_expected.expect(msg.rid, msg.page_ids)
        return Ack()

    @handles(KVPages)
    async def on_kv_pages(self, msg: KVPages, env: Envelope) -> None:
        if base_role(env.sender) != "worker":
            log.warning(
                "refused KV pages from %s: KV pages are taken from workers only", env.sender
            )
            return
        error = await self._serial.submit(lambda: self._write_pages(msg, env.sender))
        if error is None:
            return
        arrived = KVArrived(
            rid=msg.rid,
            token_id=msg.token_id,
            logprob=msg.logprob,
            top_logprobs=msg.top_logprobs,
            error=error,
        )
        await self.send(peer_of(self.role, "scheduler"), arrived)

    def _write_pages(self, msg: KVPages, sender: str) -> str | None:
        """Pages of a transfer into the pool: None while nothing is to be told (not
        expected, or more to come), else what the scheduler hears ("" when complete)."""
        expected = self.kv_expected
        if not expected.accepts(msg.rid, msg.page_ids):
            self.kv["kv_dropped"] += 1
            log.info("KV pages of %s from %s: not expected (ended); dropped", msg.rid, sender)
            return None
        try:
            write_pages(self.runner.pool, msg)
        except ValueError as exc:
            expected.drop([msg.rid])
            return str(exc)
        expected.received(msg.rid, msg.page_ids)
        self.kv["kv_received_bytes"] += msg.kv.nbytes
        if not msg.last:
            return None
        return "" if expected.complete(msg.rid) else "the KV transfer ended with pages missing"

    @handles(CompileGrammar)
    async def on_compile(self, msg: CompileGrammar, env: Envelope) -> GrammarCompiled:
        """Compile off the loop; answer when done, or fail the request at the timeout
        (the compile goes on, and its result is cached for the next request)."""
        await asyncio.wrap_future(self.grammars.prepare())  # once: the backends' tables
        t0 = time.perf_counter()
        fut = self.grammars.compile(msg.kind, msg.value)
        cached = fut.done()
        self.compiles += not cached
        limit = self.config.grammar.grammar_compile_timeout_s
        waiter = asyncio.wrap_future(fut)
        done, _ = await asyncio.wait({waiter}, timeout=limit)
        ms = (time.perf_counter() - t0) * 1e3
        if not done:
            kind = msg.kind.replace("_", " ")
            return GrammarCompiled(
                rid=msg.rid,
                error=f"compiling the {kind} took longer than {limit:g}s "
                "(--grammar-compile-timeout); simplify it or try again later",
                compile_ms=ms,
            )
        compiled = waiter.result()
        return GrammarCompiled(
            rid=msg.rid,
            backend=compiled.backend,
            error=compiled.error,
            compile_ms=ms,
            cached=cached,
        )
