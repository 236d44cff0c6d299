"""Prefill/decode disaggregation in the scheduler's policy, step by step: a decode
planner hands long prompts to a prefill planner, each against its own real
KVCacheManager and page pool, and the prompt's pages are copied from one pool to the
other as the prefill worker ships them. The stand-in model reads every slot of a
sequence's page table, so a page shipped to the wrong place, or left unwritten,
changes the output."""

from __future__ import annotations

import random

import msgspec
from actorlm.actors.cache.step import apply_step
from actorlm.messages.errors import ErrorCode
from actorlm.messages.generate import TokenDelta
from actorlm.messages.step import KVDest
from hypothesis import given, settings
from hypothesis import strategies as st

from .test_policy import PAGE, make, model, request, run

Pool = dict[tuple[int, int], int]


class Pair:
    """A decode planner and a prefill planner, each with its cache manager and pool."""

    def __init__(self, threshold: int, num_pages: int = 64, queue: int = 100) -> None:
        self.queue = queue  # prompts the prefill planner may hold
        self.d, self.d_kv = make(num_pages)
        self.p, self.p_kv = make(num_pages)
        self.d.remote_threshold = threshold
        self.d_pool: Pool = {}
        self.p_pool: Pool = {}
        self.outputs: dict[str, list[int]] = {}
        self.ended: dict[str, str] = {}

    def collect(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            self.outputs.setdefault(d.rid, []).extend(d.token_ids)
            if d.finish_reason:
                self.ended[d.rid] = d.finish_reason

    def hand_over(self) -> None:
        """What the decode scheduler actor does with each request admitted for a remote
        prefill: the prefill planner gets it, with the pages to fill."""
        for req in self.d.take_remote():
            start = req.computed // PAGE
            dest = req.pages[start : self.d.pages_for(req.prompt_len)]
            sampling = msgspec.structs.replace(req.params, max_new_tokens=1)
            kv_dest = KVDest("worker", dest, start)
            msg = msgspec.structs.replace(req.request, sampling=sampling, kv_dest=kv_dest)
            assert self.p.add(msg, "scheduler") is None

    def prefill_step(self, step_id: int, rng: random.Random, fail_p: float) -> None:
        ops = self.p.cache_ops()
        if ops is not None:
            self.p.apply_cache(apply_step(self.p_kv, ops).result)
        batch = self.p.build_batch(step_id)
        if not batch.seqs:
            return
        result = model(batch, self.p_pool)
        sampled = {r.rid: r.token_id for r in result.results}
        for seq in batch.seqs:
            if seq.ship is None:
                continue
            assert seq.rid in sampled  # the prompt's last chunk samples
            if rng.random() < fail_p:  # the transfer is lost
                self.d.remote_failed(seq.rid, "lost", ErrorCode.UNAVAILABLE)
                continue
            src = seq.page_ids[seq.ship.start_page :]
            for s, d in zip(src, seq.ship.page_ids, strict=True):  # the worker's copy
                for slot in range(PAGE):
                    if (s, slot) in self.p_pool:
                        self.d_pool[(d, slot)] = self.p_pool[(s, slot)]
            self.d.remote_done(seq.rid, sampled[seq.rid])
        for delta in self.p.on_result(batch, result):
            assert delta.error is None and delta.token_ids == [sampled[delta.rid]]

    def run(self, rng: random.Random, abort_p: float = 0.0, fail_p: float = 0.0) -> None:
        for step_id in range(10_000):
            self.collect(self.d.take_deltas())
            if not (self.d.has_work() or self.d.remote or self.p.has_work()):
                break
            ops = self.d.cache_ops()
            if ops is not None:
                self.d.remote_slots = self.queue - len(self.d.remote)  # as the actor counts
                self.d.apply_cache(apply_step(self.d_kv, ops).result)
                self.hand_over()
            live = [*self.d.waiting, *self.d.running, *self.d.remote]
            if live and rng.random() < abort_p:
                self.d.abort(rng.choice(live))
            self.prefill_step(step_id, rng, fail_p)
            batch = self.d.build_batch(step_id)
            if batch.seqs:
                self.collect(self.d.on_result(batch, model(batch, self.d_pool)))
            self.d_kv.check_invariants()
            self.p_kv.check_invariants()
        assert not (self.d.has_work() or self.d.remote or self.p.has_work())

    def done(self) -> dict[str, list[int]]:
        return {r: self.outputs[r] for r, why in self.ended.items() if why in ("length", "stop")}


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    shared = [rng.randrange(1000) for _ in range(12)]  # three pages: some tails go remote
    return [
        (shared if i % 2 else []) + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
        for i in range(n)
    ]


def test_a_remote_prefill_gives_the_outputs_of_a_local_one() -> None:
    rng = random.Random(5)
    prompts = _prompts(rng, 12)
    one, one_kv = make(256)
    pair = Pair(threshold=8, num_pages=256)
    for i, p in enumerate(prompts):
        assert one.add(request(f"r{i}", p, 6), "t") is None
        assert pair.d.add(request(f"r{i}", p, 6), "t") is None
    want = run(one, one_kv, rng, 0.0)
    pair.run(rng)
    assert pair.done() == want and len(want) == 12
    stats = pair.d.stats
    # both branches: long tails remote (some after a cached prefix), short ones here
    assert stats["pd_remote_prefills"] >= 4 and stats["pd_local_prefills"] >= 2, stats
    assert stats["pd_transfer_failures"] == 0


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    abort_p=st.sampled_from([0.0, 0.1, 0.4]),
    fail_p=st.sampled_from([0.0, 0.3]),
)
def test_every_page_comes_back_on_both_sides(seed: int, abort_p: float, fail_p: float) -> None:
    rng = random.Random(seed)
    pair = Pair(rng.choice([0, 4, 8]), num_pages=rng.randint(24, 64), queue=rng.choice([1, 3]))
    for i, p in enumerate(_prompts(rng, 10)):
        assert pair.d.add(request(f"r{i}", p, rng.randint(1, 8)), "t") is None
    pair.run(rng, abort_p, fail_p)
    for kv in (pair.d_kv, pair.p_kv):
        kv.flush()
        assert kv.allocator.num_free == kv.allocator.num_pages, kv.stats()
    failed = [r for r, why in pair.ended.items() if why == "error"]
    assert len(failed) == pair.d.stats["pd_transfer_failures"]


def test_an_aborted_or_failed_remote_prefill_gives_its_pages_back() -> None:
    pair = Pair(threshold=4)
    pair.d.remote_slots = 2
    for rid, first in (("a", 0), ("b", 30)):
        assert pair.d.add(request(rid, list(range(first, first + 20)), 4), "t") is None
    pair.d.apply_cache(apply_step(pair.d_kv, pair.d.cache_ops()).result)
    assert set(pair.d.remote) == {"a", "b"} and not pair.d.running
    assert pair.d_kv.allocator.num_free == 64 - 12  # six pages each (prompt, next token)
    assert pair.d.abort("a")
    assert pair.d.remote_failed("b", "the prefill replica died", ErrorCode.UNAVAILABLE)
    assert not pair.d.remote_done("a", 7)  # a late arrival changes nothing
    deltas = pair.d.take_deltas()
    assert [(d.rid, d.finish_reason) for d in deltas] == [("a", "abort"), ("b", "error")]
    assert deltas[1].error_code is ErrorCode.UNAVAILABLE
    ops = pair.d.cache_ops()
    assert ops is not None and sorted(ops.releases) == ["a", "b"]
    pair.d.apply_cache(apply_step(pair.d_kv, ops).result)
    assert pair.d_kv.allocator.num_free == 64  # none cached: their KV may never have come
    assert pair.d.build_batch(1).release == []  # an empty batch is never sent: they wait
    assert pair.d.add(request("c", [1, 2, 3], 4), "t") is None
    pair.d.apply_cache(apply_step(pair.d_kv, pair.d.cache_ops()).result)
    assert sorted(pair.d.build_batch(2).release) == ["a", "b"]  # the worker drops them too


def test_past_the_prefill_queue_long_prompts_are_prefilled_here() -> None:
    pair = Pair(threshold=4)
    pair.d.remote_slots = 1  # the prefill replica has room for one more
    for rid, first in (("a", 0), ("b", 30), ("c", 60)):
        prompt = list(range(first, first + (3 if rid == "c" else 20)))
        assert pair.d.add(request(rid, prompt, 4), "t") is None
    pair.d.apply_cache(apply_step(pair.d_kv, pair.d.cache_ops()).result)
    assert list(pair.d.remote) == ["a"] and set(pair.d.running) == {"b", "c"}
    stats = pair.d.stats
    assert (stats["pd_remote_prefills"], stats["pd_local_busy"], stats["pd_local_prefills"]) == (
        1,
        1,
        1,
    )
