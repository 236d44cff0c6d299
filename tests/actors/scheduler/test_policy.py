"""The scheduler's policy driven step by step against the real KVCacheManager.

No processes: the cache manager's answer is computed by the same code the actor
runs, and the worker's by a deterministic stand-in for the model (the next
token is a hash of the sequence so far), so every interleaving of aborts,
finishes and retractions can be replayed exactly.
"""

from __future__ import annotations

import random

import msgspec
from actorlm.actors.cache.kv_cache import KVCacheManager
from actorlm.actors.cache.step import apply_step
from actorlm.actors.scheduler.policy import PENDING, BatchPlanner
from actorlm.config import SchedulerConfig
from actorlm.messages.errors import ErrorCode
from actorlm.messages.generate import TokenDelta, TokenizedRequest
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import ForwardBatch, SeqResult, StepResult
from hypothesis import given, settings
from hypothesis import strategies as st

PAGE = 4


def model(batch: ForwardBatch, pool: dict[tuple[int, int], int]) -> StepResult:
    """A stand-in for the model that reads what the KV pages hold: each input token is
    written into its page slot, and the next token is a hash of every slot the sequence's
    page table covers. A page that holds the wrong tokens (a stale prefix, a page written
    by someone else) changes the output, as it would with a real model."""
    results = []
    for seq in batch.seqs:
        for i, token in enumerate(seq.input_ids):
            pos = seq.start_pos + i
            pool[(seq.page_ids[pos // PAGE], pos % PAGE)] = token
        if seq.sample:
            end = seq.start_pos + len(seq.input_ids)
            seen = tuple(pool.get((seq.page_ids[p // PAGE], p % PAGE)) for p in range(end))
            results.append(SeqResult(seq.rid, hash(seen) % 1000 + 10))
    return StepResult(step_id=batch.step_id, results=results)


def request(rid: str, prompt: list[int], n: int) -> TokenizedRequest:
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return TokenizedRequest(rid=rid, input_ids=prompt, sampling=sp)


def run(
    planner: BatchPlanner, kv: KVCacheManager, rng: random.Random, abort_p: float
) -> dict[str, list[int]]:
    history: dict[tuple[int, int], int] = {}
    outputs: dict[str, list[int]] = {}
    ended: dict[str, str] = {}

    def collect(deltas: list[TokenDelta]) -> None:
        for d in deltas:
            outputs.setdefault(d.rid, []).extend(d.token_ids)
            if d.finish_reason:
                ended[d.rid] = d.finish_reason

    def maybe_abort() -> None:
        live = list(planner.waiting) + list(planner.running)
        if live and rng.random() < abort_p:
            planner.abort(rng.choice(live))

    for step_id in range(10_000):
        collect(planner.take_deltas())
        if not planner.has_work():
            break
        ops = planner.cache_ops()
        maybe_abort()
        if ops is not None:
            planner.apply_cache(apply_step(kv, ops).result)
        batch = planner.build_batch(step_id)
        maybe_abort()
        if batch.seqs:
            collect(planner.on_result(batch, model(batch, history)))
        kv.check_invariants()
    assert not planner.has_work(), "the planner did not drain"
    return {rid: outputs.get(rid, []) for rid in ended if ended[rid] in ("length", "stop")}


def make(
    num_pages: int, max_running: int = 8, page_run: int = 1
) -> tuple[BatchPlanner, KVCacheManager]:
    cfg = SchedulerConfig(
        max_running_requests=max_running, max_prefill_tokens=24, decode_page_run=page_run
    )
    planner = BatchPlanner(cfg, page_size=PAGE, num_pages=num_pages, max_model_len=4096)
    return planner, KVCacheManager(num_pages, PAGE)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_pages=st.integers(16, 64),
    abort_p=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_every_page_comes_back_whatever_the_interleaving(
    seed: int, num_pages: int, abort_p: float
) -> None:
    rng = random.Random(seed)
    planner, kv = make(num_pages)
    shared = [rng.randrange(1000) for _ in range(12)]
    for i in range(12):
        prompt = (shared if i % 2 else []) + [
            rng.randrange(1000) for _ in range(rng.randint(1, 30))
        ]
        assert planner.add(request(f"r{i}", prompt, rng.randint(1, 12)), "tokenizer") is None
    run(planner, kv, rng, abort_p)
    kv.flush()
    assert kv.allocator.num_free == num_pages, kv.stats()


def test_retraction_keeps_outputs_identical() -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(5, 20))] for _ in range(10)]
    roomy, roomy_kv = make(512)
    tight, tight_kv = make(12)
    for i, p in enumerate(prompts):
        roomy.add(request(f"r{i}", p, 16), "t")
        tight.add(request(f"r{i}", p, 16), "t")
    want = run(roomy, roomy_kv, rng, 0.0)
    got = run(tight, tight_kv, rng, 0.0)
    assert tight.stats["retractions"] > 0
    assert got == want and len(got) == 10


def test_a_request_that_can_never_fit_is_refused_at_once() -> None:
    planner, _ = make(4)
    refused = planner.add(request("big", list(range(40)), 8), "t")
    assert refused is not None and "KV cache" in refused.message


def test_a_request_queued_too_long_fails_as_overloaded() -> None:
    now = [100.0]
    cfg = SchedulerConfig(max_running_requests=1, max_prefill_tokens=24)
    planner = BatchPlanner(
        cfg, page_size=PAGE, num_pages=64, max_model_len=4096, clock=lambda: now[0]
    )
    kv = KVCacheManager(64, PAGE)
    assert planner.add(request("a", [1, 2, 3], 50), "t") is None
    planner.apply_cache(apply_step(kv, planner.cache_ops()).result)  # "a" runs; "b" can only wait
    assert planner.add(request("b", [4, 5, 6], 5), "t") is None
    now[0] += 30
    assert planner.expire_waiting(60.0) == 0
    now[0] += 31
    assert planner.expire_waiting(60.0) == 1 and "b" not in planner.waiting
    (delta,) = planner.take_deltas()
    assert delta.rid == "b" and delta.error_code is ErrorCode.OVERLOADED and "61s" in delta.error
    assert "a" in planner.running  # a running request is never expired


def test_requeued_requests_come_back_with_their_outputs() -> None:
    planner, kv = make(64)
    assert planner.add(request("a", [1, 2, 3, 4, 5], 6), "t") is None
    planner.apply_cache(apply_step(kv, planner.cache_ops()).result)
    history: dict[tuple[int, int], int] = {}
    for step_id in range(3):
        batch = planner.build_batch(step_id)
        planner.on_result(batch, model(batch, history))
        ops = planner.cache_ops()
        if ops is not None:
            planner.apply_cache(apply_step(kv, ops).result)
    before = list(planner.running["a"].ids)
    planner.pool_lost()
    planner.requeue_running()
    req = planner.waiting["a"]
    assert req.ids == before and req.computed == 0 and req.pages == [] and req.needs_init
    fresh = KVCacheManager(64, PAGE)  # the cache manager starts over with the next epoch
    planner.apply_cache(apply_step(fresh, planner.cache_ops()).result)
    batch = planner.build_batch(10)
    (seq,) = batch.seqs
    assert seq.start_pos == 0 and seq.input_ids == before and seq.init is not None


def _forward(
    batch: ForwardBatch, history: dict[tuple[int, int], int], last: dict[str, int]
) -> StepResult:
    """The worker: fills in PENDING inputs with each sequence's last sampled token."""
    for rid in batch.release:
        last.pop(rid, None)
    seqs = [
        msgspec.structs.replace(
            s, input_ids=[last[s.rid] if t == PENDING else t for t in s.input_ids]
        )
        for s in batch.seqs
    ]
    result = model(ForwardBatch(step_id=batch.step_id, seqs=seqs), history)
    last.update((r.rid, r.token_id) for r in result.results)
    return result


def run_pipelined(
    planner: BatchPlanner, kv: KVCacheManager, rng: random.Random, abort_p: float
) -> dict[str, list[int]]:
    """As the scheduler runs with overlap: step N+1 is planned and sent (the worker runs
    steps in order) before step N's result is taken; aborts land anywhere in between."""
    history: dict[tuple[int, int], int] = {}
    last: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    ended: dict[str, str] = {}
    flight: list[tuple[ForwardBatch, StepResult]] = []

    def collect(deltas: list[TokenDelta]) -> None:
        for d in deltas:
            assert d.rid not in ended, f"{d.rid} got a delta after it ended"
            outputs.setdefault(d.rid, []).extend(d.token_ids)
            if d.finish_reason:
                ended[d.rid] = d.finish_reason

    def maybe_abort() -> None:
        live = list(planner.waiting) + list(planner.running)
        if live and rng.random() < abort_p:
            planner.abort(rng.choice(live))

    for step_id in range(10_000):
        collect(planner.take_deltas())
        if not flight and not planner.has_work():
            break
        ops = planner.cache_ops()
        maybe_abort()
        if ops is not None:
            planner.apply_cache(apply_step(kv, ops).result)
        batch = planner.build_batch(step_id)
        if batch.seqs:
            flight.append((batch, _forward(batch, history, last)))
        if flight and (len(flight) == 2 or not batch.seqs):
            done, result = flight.pop(0)
            maybe_abort()
            collect(planner.on_result(done, result))
        kv.check_invariants()
    assert not planner.has_work() and planner.in_flight == 0, "the planner did not drain"
    ops = planner.cache_ops()
    if ops is not None:
        planner.apply_cache(apply_step(kv, ops).result)
    assert kv.num_private_pages == 0 and len(kv._requests) == 0  # every page came back
    return {rid: outputs.get(rid, []) for rid in ended if ended[rid] in ("length", "stop")}


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_pages=st.integers(24, 64),
    abort_p=st.sampled_from([0.0, 0.1]),
)
def test_overlap_gives_the_same_tokens(seed: int, num_pages: int, abort_p: float) -> None:
    """Chunked prefill, stop tokens (zombies), retraction under a small pool and aborts:
    every request that completes gets the tokens it gets without overlap."""
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(10)]
    reqs = []
    for i in range(10):
        prompt = shared[: rng.randint(0, 10)] + [
            rng.randrange(1000) for _ in range(rng.randint(1, 30))
        ]
        sp = SamplingParams(
            max_new_tokens=rng.randint(1, 16),
            temperature=0.0,
            ignore_eos=True,
            stop_token_ids=list(range(10, 10 + rng.choice([0, 60]))),  # some stop early
        )
        reqs.append(TokenizedRequest(rid=f"r{i}", input_ids=prompt, sampling=sp))
    outs = []
    for pipelined in (False, True):
        planner, kv = make(num_pages)
        for req in reqs:
            assert planner.add(req, "t") is None
        runner = run_pipelined if pipelined else run
        outs.append(runner(planner, kv, random.Random(seed + 1), abort_p))
    plain, overlapped = outs
    both = set(plain) & set(overlapped)
    assert {rid: plain[rid] for rid in both} == {rid: overlapped[rid] for rid in both}
    if abort_p == 0:
        assert set(plain) == set(overlapped) == {r.rid for r in reqs}


def test_overlap_takes_the_zombie_and_deferred_retraction_paths() -> None:
    """A fixed run that must leave zombies (stop tokens with a step in flight) and retract
    under a tight pool, with the same tokens as without overlap."""
    rng = random.Random(5)
    reqs = [
        TokenizedRequest(
            rid=f"r{i}",
            input_ids=[rng.randrange(1000) for _ in range(rng.randint(5, 20))],
            sampling=SamplingParams(
                max_new_tokens=16,
                temperature=0.0,
                ignore_eos=True,
                stop_token_ids=list(range(10, 110)),
            ),
        )
        for i in range(10)
    ]
    outs, planners = [], []
    for runner in (run, run_pipelined):
        planner, kv = make(14)
        for req in reqs:
            planner.add(req, "t")
        outs.append(runner(planner, kv, random.Random(0), 0.0))
        planners.append(planner)
    assert outs[0] == outs[1] and len(outs[0]) == 10
    assert planners[1].stats["zombies"] > 0 and planners[1].stats["retractions"] > 0


def _chunks(planner: BatchPlanner, kv: KVCacheManager, step_id: int) -> dict[str, int]:
    """One plain step: its cache exchange, then each sequence's tokens in the batch."""
    ops = planner.cache_ops()
    if ops is not None:
        planner.apply_cache(apply_step(kv, ops).result)
    batch = planner.build_batch(step_id)
    planner.on_result(batch, model(batch, {}))
    return {s.rid: len(s.input_ids) for s in batch.seqs}


def test_a_short_prompt_goes_before_a_long_one_being_chunked() -> None:
    """A prompt that ends within half the step's budget (24 tokens here) is computed in
    the step after it arrives, ahead of a long prompt still being chunked, which keeps
    the rest of every step. The priority policy keeps admission order."""
    for policy, short_first in (("fcfs", True), ("lpm", True), ("priority", False)):
        cfg = SchedulerConfig(max_running_requests=8, max_prefill_tokens=24, policy=policy)
        planner = BatchPlanner(cfg, page_size=PAGE, num_pages=64, max_model_len=4096)
        kv = KVCacheManager(64, PAGE)
        assert planner.add(request("long", list(range(100, 170)), 2), "t") is None
        assert _chunks(planner, kv, 0) == {"long": 24}
        assert planner.add(request("short", [7, 8, 9, 10, 11], 2), "t") is None
        got = _chunks(planner, kv, 1)
        if short_first:
            assert got == {"short": 5, "long": 19}, policy
        else:
            assert got == {"long": 24}, policy


def _runs(pages: list[int]) -> list[int]:
    """The lengths of the runs of consecutive ids in a page table."""
    runs = [1]
    for a, b in zip(pages, pages[1:], strict=False):
        runs[-1:] = [runs[-1] + 1] if b == a + 1 else [runs[-1], 1]
    return runs


def test_decodes_side_by_side_get_their_pages_in_runs() -> None:
    """Sequences decoding together ask for their pages ``decode_page_run`` at a time, so
    each one's table is runs of consecutive ids (its K and V in runs a CPU's prefetcher
    follows), never past its last token's page, and outputs are unchanged; in a pool
    with nothing to spare (4 x 12 of 48 pages), runs stop once 3/4 of it is taken."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(6)] for _ in range(4)]
    outs = []
    for num_pages in (256, 48):
        planner, kv = make(num_pages, page_run=8)
        for i, p in enumerate(prompts):
            assert planner.add(request(f"r{i}", p, 40), "t") is None
        history: dict[tuple[int, int], int] = {}
        tables: dict[str, list[int]] = {}
        outputs: dict[str, list[int]] = {}
        for step_id in range(60):
            ops = planner.cache_ops()
            if ops is not None:
                planner.apply_cache(apply_step(kv, ops).result)
            tables.update({r.rid: list(r.pages) for r in planner.running.values()})
            batch = planner.build_batch(step_id)
            if not batch.seqs:
                break
            for d in planner.on_result(batch, model(batch, history)):
                outputs.setdefault(d.rid, []).extend(d.token_ids)
            kv.check_invariants()
        outs.append(outputs)
        last = -(-(6 + 40 - 1) // PAGE)  # the KV of a prompt and its new tokens but the last
        for rid, table in tables.items():
            assert len(table) == last, (rid, table)
            if num_pages == 256:  # the prompt's 2 pages with 7 more, then the last 3
                assert _runs(table) == [9, 3], (rid, table)
            else:
                assert _runs(table) == [9, 1, 1, 1], (rid, table)
        kv.flush()
        assert kv.allocator.num_free == num_pages
    assert outs[0] == outs[1] and all(len(v) == 40 for v in outs[0].values())
