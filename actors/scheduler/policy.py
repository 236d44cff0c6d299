"""The scheduler's policy: waiting queue, running batch, chunked prefill,
admission, retraction and finishing. Pure Python over message structs: no
asyncio, zmq or torch, so it is tested step by step without processes.

One step is: ``cache_ops()`` → (cache manager) → ``apply_cache()`` →
``build_batch()`` → (worker) → ``on_result()``. Every request is a token list
(prompt, then outputs) of which ``computed`` tokens are in its KV pages; a step
computes the next chunk of it. A decode is the chunk of one token; a retracted
request comes back as a prefill of everything it had, mostly served from the
prefix cache.

Overlap (``lookahead=True``): while the worker runs step N, the next step is
planned and sent, so the worker goes from one to the next without waiting for the
scheduler. A request in step N is planned ``ahead`` of what is computed; where N
samples its next token, step N+1 names it ``PENDING`` and the worker fills it in.
A request that finishes (or is aborted) with a step still in flight becomes a
zombie: its pages are kept until that step is back, and its extra token is dropped,
so the tokens delivered are the same with overlap on or off. Nothing is retracted
while a step is in flight: a refused page waits for the next plain step.

Prefill/decode disaggregation (``remote_threshold`` set): a fresh prompt with more
uncached tokens than that is admitted (its pages taken here) but computed on a prefill
replica; it waits in ``remote`` until its KV has arrived (``remote_done``), then
decodes here as if it had prefilled here, or ends (``remote_failed``).

A constrained request (structured output) is *held* from arrival until its grammar
is compiled (``grammar_ready``) or cannot be (``grammar_failed``): it takes no batch
slot and no page, and no one waits behind it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ...config import DEFAULT_MAX_PREFILL_TOKENS, SchedulerConfig
from ...messages.cache import AdmitOp, CacheStep, CacheStepResult, CommitOp, ExtendOp, FinishOp
from ...messages.errors import ErrorCode
from ...messages.generate import FinishReason, TokenDelta, TokenizedRequest
from ...messages.sampling import SamplingParams
from ...messages.step import (
    PENDING_TOKEN,
    ForwardBatch,
    PageIO,
    SeqInit,
    SeqStep,
    StepResult,
    TopLogprob,
)

__all__ = ["PENDING", "POLICIES", "BatchPlanner", "Refusal", "Req"]

POLICIES = ("fcfs", "lpm", "priority")
PENDING = PENDING_TOKEN  # an input the worker fills in: what this sequence sampled last


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot be queued."""

    message: str
    code: ErrorCode


@dataclass(eq=False)
class Req:
    rid: str
    ids: list[int]  # prompt, then every output token
    prompt_len: int
    request: TokenizedRequest
    reply_to: str
    seq: int  # arrival order
    stop_ids: frozenset[int] = frozenset()  # stop token ids, the model's eos included
    queued_at: float = 0.0  # when it arrived (the caller's clock)
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens of ids whose KV is in pages
    cached_tokens: int = 0
    needs_init: bool = True
    committed: bool = False
    blocked: bool = False  # refused pages this step
    ahead: int = 0  # tokens in steps in flight (not yet in ``computed``)
    pending: int = 0  # tokens those steps will sample (not yet in ``ids``)
    zombie: bool = False  # ended, but a step in flight still names it
    zombie_cache: bool = True  # when it is settled: cache its pages (else just free them)
    held: TokenDelta | None = None  # a finished zombie's last delta, sent once it is settled
    grammar_backend: str | None = None  # the backend that compiled its constraint

    @property
    def num_output(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling

    @property
    def base(self) -> int:
        """Where its next chunk starts: computed, plus what steps in flight compute."""
        return self.computed + self.ahead

    @property
    def todo(self) -> int:
        """Tokens known (or pending) whose KV no step has been asked for yet."""
        return len(self.ids) + self.pending - self.base


class BatchPlanner:
    def __init__(
        self,
        cfg: SchedulerConfig,
        *,
        page_size: int,
        num_pages: int,
        max_model_len: int,
        prefix_cache: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cfg.policy not in POLICIES:
            raise ValueError(
                f"unknown scheduling policy {cfg.policy!r}; known: {', '.join(POLICIES)}"
            )
        self.cfg = cfg
        self.clock = clock  # seconds; when a request arrives, for its queue deadline
        # 0 until a platform fills it in (resolve_config); a bare config gets the default
        self.prefill_budget = cfg.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS
        # a decode's pages asked for this many at a time (fewer where its max_new_tokens
        # needs fewer), one run of ids (KVCacheManager._alloc): on a CPU its K and V then
        # lie in runs the prefetcher follows, and its cache round trips for new pages come
        # that much less often
        self.page_run = max(1, cfg.decode_page_run)
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.prefix_cache = prefix_cache
        self.waiting: dict[str, Req] = {}
        self.running: dict[str, Req] = {}
        self.compiling: dict[str, Req] = {}  # constrained, waiting for their grammar
        self._seq = itertools.count()
        self._finishes: list[FinishOp] = []
        self._releases: list[str] = []
        self._commits: list[CommitOp] = []
        self._worker_release: list[str] = []
        self._extends: list[ExtendOp] = []
        self._deltas: list[TokenDelta] = []
        self._store_pages: list[PageIO] = []
        self._load_pages: list[PageIO] = []
        self._forget_keys: list[str] = []
        # Steps sent and not answered yet, oldest first: step id → {rid: (chunk, samples)}.
        self._flight: dict[int, dict[str, tuple[int, bool]]] = {}
        self._zombies: dict[str, Req] = {}
        self._refused = False  # a page was refused while a step was in flight
        # After a retraction, admit nothing until a request ends: admitting into the
        # pages a retraction just freed would only cause the next retraction.
        self._hold_admission = False
        # LoRA: adapters in a worker slot now; a request for any other waits (adapters.py).
        self.ready_adapters: set[str] = set()
        # Disaggregation: None = every prompt is computed here (no prefill replica up);
        # remote_slots: how many more may go to a prefill replica this step (its queue).
        self.remote_threshold: int | None = None
        self.remote_slots = 0
        self.remote: dict[str, Req] = {}  # admitted; its prompt computed elsewhere
        self._to_remote: list[Req] = []
        self.stats = {
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "cached_tokens": 0,
            "retractions": 0,
            "steps": 0,
            "zombies": 0,  # requests that ended with a step still in flight (overlap)
            "pd_remote_prefills": 0,  # prompts computed on a prefill replica
            "pd_local_prefills": 0,  # prompts computed here while one was up (short enough)
            "pd_local_busy": 0,  # long prompts computed here: the prefill replicas were full
            "pd_transfer_failures": 0,
        }

    # -- requests in and out --------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def add(self, msg: TokenizedRequest, reply_to: str) -> Refusal | None:
        """Queue a request; returns why not if it cannot be queued."""
        if msg.rid in self.waiting or msg.rid in self.running or msg.rid in self.compiling:
            return Refusal(f"request id {msg.rid!r} is already in use", ErrorCode.INVALID_REQUEST)
        limit = self.cfg.max_queued_requests  # 0: no limit, as at the gateway
        if limit and len(self.waiting) + len(self.compiling) >= limit:
            return Refusal(
                "the server is overloaded: the waiting queue is full", ErrorCode.OVERLOADED
            )
        worst = len(msg.input_ids) + msg.sampling.max_new_tokens
        if self.pages_for(worst) > self.num_pages:
            return Refusal(
                f"the request needs up to {worst} tokens of KV cache but the pool holds "
                f"{self.num_pages * self.page_size}",
                ErrorCode.INVALID_REQUEST,
            )
        sp = msg.sampling
        # A constraint decides where the output ends (its grammar then allows only eos),
        # so eos stops a constrained request even with ignore_eos.
        keep_eos = not sp.ignore_eos or sp.constraint is not None
        stops = frozenset(sp.stop_token_ids) | frozenset(msg.eos_token_ids if keep_eos else ())
        req = Req(
            msg.rid,
            list(msg.input_ids),
            len(msg.input_ids),
            msg,
            reply_to,
            next(self._seq),
            stop_ids=stops,
            queued_at=self.clock(),
        )
        if msg.sampling.max_new_tokens == 0:
            self._deltas.append(self._delta(req, [], FinishReason.LENGTH))
            return None
        if sp.constraint is not None:
            self.compiling[msg.rid] = req
            return None
        self.waiting[msg.rid] = req
        return None

    def grammar_ready(self, rid: str, backend: str) -> bool:
        """``rid``'s grammar compiled: it joins the queue (False if it is gone)."""
        req = self.compiling.pop(rid, None)
        if req is None:
            return False
        req.grammar_backend = backend
        self.waiting[rid] = req
        return True

    def grammar_failed(self, rid: str, message: str, code: ErrorCode) -> None:
        """``rid``'s constraint cannot be served: it ends with that error, alone."""
        req = self.compiling.pop(rid, None)
        if req is not None:
            self._deltas.append(self._delta(req, [], FinishReason.ERROR, error=message, code=code))

    def abort(
        self, rid: str, reason: FinishReason = FinishReason.ABORT, *, notify: bool = True
    ) -> bool:
        req = self.waiting.pop(rid, None) or self.compiling.pop(rid, None)
        if req is None and rid in self.remote:
            req = self.remote.pop(rid)
            self._releases.append(rid)  # its KV may never have come: nothing to cache
            self._worker_release.append(rid)
        elif req is None:
            req = self.running.pop(rid, None)
            if req is None:
                return False
            self._end(req)
        if notify:
            self._deltas.append(self._delta(req, [], reason))
        return True

    def fail_all(
        self, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE, *, waiting: bool = True
    ) -> None:
        """End every running (and waiting) request with an error; their KV is not cached."""
        queued = [*self.waiting.values(), *self.compiling.values()] if waiting else []
        for req in [*self.running.values(), *self.remote.values(), *queued]:
            self._deltas.append(self._delta(req, [], FinishReason.ERROR, error=message, code=code))
            if req.rid in self.running or req.rid in self.remote:
                self._releases.append(req.rid)
                self._worker_release.append(req.rid)
        for req in self._zombies.values():
            self._releases.append(req.rid)
            self._worker_release.append(req.rid)
        self.running.clear()
        self.remote.clear()
        self._zombies.clear()
        self._flight.clear()  # its steps are not coming back
        if waiting:
            self.waiting.clear()
            self.compiling.clear()

    def expire_waiting(self, max_wait: float) -> int:
        """End, as overloaded, the requests that waited more than ``max_wait`` to start
        (a retracted one has started: it stays); how many."""
        now = self.clock()
        late = [
            r for r in self.waiting.values() if r.num_output == 0 and now - r.queued_at > max_wait
        ]
        for req in late:
            del self.waiting[req.rid]
            message = (
                f"the request waited {now - req.queued_at:.0f}s in the queue without starting "
                f"(--max-queue-time-s {max_wait:g}); the server is overloaded"
            )
            self._deltas.append(
                self._delta(req, [], FinishReason.ERROR, error=message, code=ErrorCode.OVERLOADED)
            )
        return len(late)

    def pool_lost(self) -> None:
        """The KV pool's contents are gone (its worker or cache manager was lost): forget
        every pending operation on its pages. Running requests must then fail or be
        requeued; the cache manager starts over with the next pool epoch."""
        self._finishes, self._releases, self._commits = [], [], []
        self._extends = []
        self._store_pages, self._load_pages = [], []
        self._hold_admission = False
        self._flight.clear()
        self._zombies.clear()
        self._refused = False
        for req in self.running.values():
            req.ahead, req.pending = 0, 0

    def requeue_running(self) -> None:
        """Every running request goes back to the queue, to be computed again from its
        tokens (prompt and outputs so far) on the next pool: its stream goes on."""
        for req in sorted([*self.running.values(), *self.remote.values()], key=lambda r: r.seq):
            req.pages, req.computed, req.committed = [], 0, False
            req.needs_init, req.blocked, req.ahead, req.pending = True, False, 0, 0
            self.waiting[req.rid] = req
            self._worker_release.append(req.rid)
        self.running.clear()
        self.remote.clear()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finishes or self._releases)

    def zombies(self) -> list[Req]:
        """Requests that ended while a step in flight still names them."""
        return list(self._zombies.values())

    def is_zombie(self, rid: str) -> bool:
        return rid in self._zombies

    @property
    def in_flight(self) -> int:
        """Steps sent to the worker and not answered yet."""
        return len(self._flight)

    def has_finishes(self) -> bool:
        """Finished requests whose pages the cache manager has not been told of yet."""
        return bool(self._finishes)

    def take_deltas(self) -> list[TokenDelta]:
        out, self._deltas = self._deltas, []
        return out

    # -- one step ---------------------------------------------------------------
    def _candidates(self, limit: int) -> list[Req]:
        ready = self.ready_adapters
        reqs: Iterable[Req] = (
            r for r in self.waiting.values() if not r.request.lora_id or r.request.lora_id in ready
        )
        if self.cfg.policy == "priority":
            reqs = sorted(reqs, key=lambda r: (-r.request.priority, r.seq))
        else:  # fcfs, and lpm's candidates in arrival order (the cache manager reorders)
            reqs = sorted(reqs, key=lambda r: r.seq)
        return list(itertools.islice(reqs, limit))

    def cache_ops(self) -> CacheStep | None:
        """This step's cache operations, or None when there are none."""
        self._extends = []
        for req in self.running.values():
            req.blocked = False
            if req.todo == 1:  # decoding: room for one more token?
                need = self.pages_for(req.base + 1) - len(req.pages)
                if need > 0:
                    more = self._run_beyond(req, len(req.pages) + need)
                    self._extends.append(ExtendOp(req.rid, need, more))
        admits: list[AdmitOp] = []
        slots = self.cfg.max_running_requests - len(self.running)
        if self._hold_admission and self.running:
            slots = 0
        if slots > 0 and self.waiting:
            # Whole prompts count here, cached prefix or not, so prompts sharing a long
            # system prompt are admitted one a step and each gets its first token a
            # step apart. Counting only their uncached tails admits them together:
            # on 2 CPU cores that gave +8% output tok/s but 2x the p50 TTFT (a step's
            # time grows with its tokens and all wait for its end; bench/README.md).
            budget = 4 * self.prefill_budget
            for req in self._candidates(slots):
                if admits and budget <= 0:
                    break
                budget -= len(req.ids) - req.computed
                total = self.pages_for(len(req.ids) + 1)
                extra = total - self.pages_for(len(req.ids))
                more = self._run_beyond(req, total)
                admits.append(
                    AdmitOp(
                        req.rid,
                        list(req.ids),
                        extra,
                        req.request.priority,
                        req.request.lora_id,
                        more,
                    )
                )
        pending = self._finishes or self._releases or self._commits or self._forget_keys
        if not (admits or self._extends or pending):
            return None
        step = CacheStep(
            finishes=self._finishes,
            releases=self._releases,
            commits=self._commits,
            extends=self._extends,
            admits=admits,
            longest_prefix_first=self.cfg.policy == "lpm",
            forget_keys=self._forget_keys,
        )
        self._finishes, self._releases, self._commits = [], [], []
        self._forget_keys = []
        return step

    def _run_beyond(self, req: Req, pages: int) -> int:
        """Pages to ask for past the first ``pages`` of ``req``'s table, so that its next
        ones come with them as a run (``page_run``), none past its last token's."""
        last = self.pages_for(req.prompt_len + req.params.max_new_tokens)
        return max(0, min(self.page_run - 1, last - pages))

    def apply_cache(self, result: CacheStepResult) -> None:
        self._store_pages += result.store_pages
        self._load_pages += result.load_pages
        for adm in result.admitted:
            req = self.waiting.pop(adm.rid, None)
            if req is None:  # aborted while the cache step was in flight
                self._releases.append(adm.rid)
                continue
            req.pages, req.computed = list(adm.page_ids), adm.cached_len
            req.cached_tokens = max(req.cached_tokens, adm.cached_len)
            self.stats["cached_tokens"] += adm.cached_len
            req.needs_init = True
            if self._goes_remote(req):
                self.remote[req.rid] = req
                self._to_remote.append(req)
                continue
            self.running[req.rid] = req
        for rid, table in result.committed.items():
            if rid in self.running:
                self.running[rid].pages = list(table)
        refused = False
        for rid in (op.rid for op in self._extends):
            req = self.running.get(rid)
            if req is None:
                continue
            if rid in result.extended:
                req.pages.extend(result.extended[rid])
            else:
                req.blocked, refused = True, True
        if refused and self._flight:
            self._refused = True  # retract once the steps in flight are back
        elif refused:
            self._retract_one()

    # -- prefill/decode disaggregation --------------------------------------------
    def _goes_remote(self, req: Req) -> bool:
        """Whether ``req``'s prompt is computed on a prefill replica (counted either way
        while one is up): a fresh prompt with more uncached tokens than the threshold."""
        if self.remote_threshold is None or req.num_output or req.request.lora_id:
            return False
        if len(req.ids) - req.computed <= self.remote_threshold:
            self.stats["pd_local_prefills"] += 1
            return False
        if self.remote_slots <= 0:  # long, but every prefill replica's queue is full
            self.stats["pd_local_busy"] += 1
            return False
        self.remote_slots -= 1
        self.stats["pd_remote_prefills"] += 1
        return True

    def take_remote(self) -> list[Req]:
        """The requests admitted for a remote prefill since the last call."""
        out, self._to_remote = self._to_remote, []
        return out

    def remote_done(
        self,
        rid: str,
        token: int,
        logprob: float | None = None,
        top: list[TopLogprob] | None = None,
    ) -> bool:
        """``rid``'s prompt KV is in its pages and ``token`` was its first sample: it
        decodes here from now on. False if it ended meanwhile."""
        req = self.remote.pop(rid, None)
        if req is None:
            return False
        req.computed = len(req.ids)
        req.ids.append(token)
        if self.prefix_cache:
            req.committed = True
            self._commits.append(CommitOp(req.rid, req.ids[: req.computed]))
        reason = self._finish_reason(req, token)
        lps = [logprob] if logprob is not None else None
        tops = [top] if top is not None else None
        self._deltas.append(self._delta(req, [token], reason, logprobs=lps, top=tops))
        if reason is None:
            self.running[rid] = req
        else:
            self._end(req)
        return True

    def release_worker(self, rid: str) -> None:
        """Have the next step's batch tell the worker to drop ``rid``'s state."""
        self._worker_release.append(rid)

    def remote_failed(self, rid: str, message: str, code: ErrorCode) -> bool:
        """``rid``'s remote prefill failed: it ends with that error, its pages go back."""
        req = self.remote.pop(rid, None)
        if req is None:
            return False
        self.stats["pd_transfer_failures"] += 1
        self._deltas.append(self._delta(req, [], FinishReason.ERROR, error=message, code=code))
        self._releases.append(rid)
        self._worker_release.append(rid)
        return True

    def _retract_one(self) -> None:
        """Out of pages mid-decode: requeue the newest running request. Its computed
        KV is cached (evictable), so coming back is mostly a prefix-cache hit."""
        victim = max(self.running.values(), key=lambda r: r.seq)
        del self.running[victim.rid]
        self._finish_pages(victim, cache=True)
        victim.pages, victim.computed, victim.committed = [], 0, False
        victim.needs_init = True
        self.waiting[victim.rid] = victim
        self.stats["retractions"] += 1
        self._hold_admission = True

    def build_batch(self, step_id: int) -> ForwardBatch:
        """The next step's batch. With a step in flight (overlap) it goes on from where
        that one ends; empty if a page was refused meanwhile (a plain step comes first)."""
        if self._flight and self._refused:
            return ForwardBatch(step_id=step_id, seqs=[])
        budget = self.prefill_budget
        seqs: list[SeqStep] = []
        plan: dict[str, tuple[int, bool]] = {}
        decodes = [r for r in self.running.values() if r.todo == 1]
        prefills = self._prefill_order([r for r in self.running.values() if r.todo > 1], budget)
        for req in decodes + prefills:
            if req.blocked or req.num_output + req.pending >= req.params.max_new_tokens:
                continue  # refused a page, or its last token is in a step in flight
            remaining = req.todo
            chunk = 1 if remaining == 1 else min(remaining, budget)
            if chunk <= 0:
                continue
            budget -= chunk
            start, end = req.base, req.base + chunk
            init = None
            if req.needs_init:
                init = SeqInit(
                    sampling=req.params,
                    token_ids=list(req.ids),
                    prompt_len=req.prompt_len,
                    eos_token_ids=list(req.request.eos_token_ids),
                )
                req.needs_init = False
            table = req.pages[: self.pages_for(end)]
            sample = end == len(req.ids) + req.pending
            ids = req.ids[start:end] if end <= len(req.ids) else [PENDING]
            # a prefill replica's prompt: its pages go once it is computed
            ship = req.request.kv_dest if end == req.prompt_len else None
            seqs.append(SeqStep(req.rid, ids, start, table, sample, init, ship))
            plan[req.rid] = (chunk, sample)
        if not seqs:  # never sent: the releases wait for a batch that is
            return ForwardBatch(step_id=step_id, seqs=[])
        release, self._worker_release = self._worker_release, []
        for rid, (chunk, sample) in plan.items():
            req = self.running[rid]
            req.ahead += chunk
            req.pending += sample
        self._flight[step_id] = plan
        stores, loads = self._store_pages, self._load_pages
        self._store_pages, self._load_pages = [], []
        return ForwardBatch(
            step_id=step_id, seqs=seqs, release=release, store_pages=stores, load_pages=loads
        )

    def _prefill_order(self, prefills: list[Req], budget: int) -> list[Req]:
        """Prefills in admission order, except that those ending within half the step's
        budget go first (in admission order too): a follow-up over a cached system
        prompt, or a long prompt's last chunk, is not held behind a long cold prompt
        being chunked until that one is done, and the long one still gets at least half
        of every step. On 2 cores a cold ~1,070-token prompt takes ~5 steps; a cached
        one's ~40-token tail waited for them. The priority policy keeps its order."""
        if self.cfg.policy == "priority":
            return prefills
        quick: list[Req] = []
        rest: list[Req] = []
        room = budget // 2
        for req in prefills:
            if not req.blocked and req.todo <= room:
                quick.append(req)
                room -= req.todo
            else:
                rest.append(req)
        return quick + rest

    def on_result(self, batch: ForwardBatch, result: StepResult) -> list[TokenDelta]:
        self.stats["steps"] += 1
        plan = self._landed(batch)
        for err in result.errors:
            self._fail(err.rid, err.message, err.code)
        self._forget_keys += result.lost_keys
        by_rid = {r.rid: r for r in result.results}
        for seq in batch.seqs:
            req = self.running.get(seq.rid)
            if req is None or seq.rid not in plan:
                continue  # ended while the step ran
            chunk, _ = plan[seq.rid]
            req.computed += chunk
            key = "decode_tokens" if chunk == 1 and req.num_output > 0 else "prefill_tokens"
            self.stats[key] += chunk
            res = by_rid.get(seq.rid)
            if res is None:
                continue
            req.ids.append(res.token_id)
            if self.prefix_cache and not req.committed:
                req.committed = True
                self._commits.append(CommitOp(req.rid, req.ids[: req.computed]))
            reason = self._finish_reason(req, res.token_id)
            lps = [res.logprob] if res.logprob is not None else None
            tops: list[list[TopLogprob]] | None = (
                [res.top_logprobs] if res.top_logprobs is not None else None
            )
            delta = self._delta(req, [res.token_id], reason, logprobs=lps, top=tops)
            if reason is None:
                self._deltas.append(delta)
                continue
            del self.running[req.rid]
            if req.ahead:  # its last delta waits until its pages are back (see _landed)
                req.held = delta
            else:
                self._deltas.append(delta)
            self._end(req)
        if not self._flight and self._refused:
            self._refused = False
        return self.take_deltas()

    def _landed(self, batch: ForwardBatch) -> dict[str, tuple[int, bool]]:
        """Step ``batch`` is back: take its plan off the flight, settle zombies it held."""
        plan = self._flight.pop(batch.step_id, {})
        for rid, (chunk, sample) in plan.items():
            req = self.running.get(rid) or self._zombies.get(rid)
            if req is None:
                continue
            req.ahead -= chunk
            req.pending -= sample
            if req.zombie and req.ahead == 0:
                del self._zombies[rid]
                self._finish_pages(req, cache=req.zombie_cache)
                if req.held is not None:
                    self._deltas.append(req.held)
                    req.held = None
        return plan

    def fail_batch(
        self, batch: ForwardBatch, message: str, code: ErrorCode = ErrorCode.INTERNAL
    ) -> None:
        plan = self._flight.pop(batch.step_id, {})
        for seq in batch.seqs:
            self._fail(seq.rid, message, code)
            zombie = self._zombies.pop(seq.rid, None)
            if zombie is not None:
                self._releases.append(zombie.rid)
                self._worker_release.append(zombie.rid)
        for rid, (chunk, sample) in plan.items():
            req = self.running.get(rid)
            if req is not None:
                req.ahead -= chunk
                req.pending -= sample

    def _fail(self, rid: str, message: str, code: ErrorCode) -> None:
        """End running ``rid`` with an error; its pages go back uncached."""
        req = self.running.pop(rid, None)
        if req is not None:
            self._deltas.append(self._delta(req, [], FinishReason.ERROR, error=message, code=code))
            if req.ahead:  # a step in flight still writes into its pages
                req.zombie, req.zombie_cache = True, False
                self._zombies[rid] = req
                self.stats["zombies"] += 1
                return
            self._releases.append(req.rid)
            self._worker_release.append(req.rid)

    def _end(self, req: Req) -> None:
        """``req`` left the running batch (finished, aborted): its pages go back, cached,
        once no step in flight writes into them."""
        if req.ahead:
            req.zombie, req.zombie_cache = True, True
            self._zombies[req.rid] = req
            self.stats["zombies"] += 1
            return
        self._finish_pages(req, cache=True)

    # -- helpers ----------------------------------------------------------------
    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        sp = req.params
        if token in req.stop_ids and req.num_output >= sp.min_new_tokens:
            return FinishReason.STOP
        if req.num_output >= sp.max_new_tokens or len(req.ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish_pages(self, req: Req, cache: bool) -> None:
        self._hold_admission = False
        self._finishes.append(
            FinishOp(req.rid, req.ids[: req.computed], cache and self.prefix_cache)
        )
        self._worker_release.append(req.rid)

    def _delta(
        self,
        req: Req,
        tokens: list[int],
        reason: FinishReason | None,
        *,
        logprobs: list[float] | None = None,
        top: list[list[TopLogprob]] | None = None,
        error: str | None = None,
        code: ErrorCode | None = None,
    ) -> TokenDelta:
        return TokenDelta(
            rid=req.rid,
            token_ids=tokens,
            logprobs=logprobs,
            top_logprobs=top,
            finish_reason=reason,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens,
            error=error,
            error_code=code,
            grammar_backend=req.grammar_backend if reason is not None else None,
        )
