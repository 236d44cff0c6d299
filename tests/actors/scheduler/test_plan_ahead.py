"""When the scheduler plans the next step with one in flight (overlap), driven in the
actor harness: the real SchedulerActor, the real cache manager's step logic behind a
scripted ``cache_manager``, and a scripted worker whose steps the test ends.

While a step with prompt tokens runs, and such steps take LONG_PROMPT_STEP_MS or more
(here: before any has come back, and after one took 80 ms), the next step is not
planned: a request arriving meanwhile rides in it. Past decode-only steps, or where
prompt steps are short, the next step is planned at once, as SGLang's overlap does."""

from __future__ import annotations

import asyncio

import pytest
from actorlm.actors.cache.kv_cache import KVCacheManager
from actorlm.actors.cache.step import apply_step
from actorlm.actors.runtime.harness import ActorHarness
from actorlm.actors.scheduler.actor import LONG_PROMPT_STEP_MS, SchedulerActor
from actorlm.config import EngineConfig, ModelConfig, SchedulerConfig
from actorlm.messages.cache import CacheStep, CacheStepResult
from actorlm.messages.generate import TokenizedRequest
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import ForwardBatch, SeqResult, StepResult

PAGE = 16
BUDGET = 64  # prompt tokens a step


class Worker:
    """Answers each step when the test says so, with ``forward_ms`` of its choice."""

    def __init__(self) -> None:
        self.batches: list[ForwardBatch] = []
        self.gates: list[asyncio.Event] = []
        self.forward_ms: list[float] = []

    async def __call__(self, batch: ForwardBatch) -> StepResult:
        self.batches.append(batch)
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        results = [SeqResult(s.rid, 7) for s in batch.seqs if s.sample]
        return StepResult(step_id=batch.step_id, results=results, forward_ms=self.forward_ms.pop(0))

    def end(self, step: int, forward_ms: float) -> None:
        self.forward_ms.append(forward_ms)
        self.gates[step].set()

    def rids(self, step: int) -> set[str]:
        return {s.rid for s in self.batches[step].seqs}

    async def drain(self, h: ActorHarness, forward_ms: float) -> None:
        """End every step, those it leads to too, until none is left; then forget them."""
        while open_ := [i for i, gate in enumerate(self.gates) if not gate.is_set()]:
            self.end(open_[0], forward_ms)
            await h.settle()
        self.batches.clear()
        self.gates.clear()


def _request(rid: str, n: int, first: int) -> TokenizedRequest:
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    return TokenizedRequest(rid=rid, input_ids=list(range(first, first + n)), sampling=sampling)


async def _harness(worker: Worker) -> ActorHarness:
    config = EngineConfig(
        model=ModelConfig(num_pages=64, max_model_len=1024, page_size=PAGE),
        scheduler=SchedulerConfig(max_prefill_tokens=BUDGET),
    )
    kv = KVCacheManager(64, PAGE)

    def cache(msg: CacheStep) -> CacheStepResult:
        return apply_step(kv, msg).result

    h = ActorHarness(SchedulerActor(config))
    h.on("cache_manager", CacheStep, cache)
    h.on("worker", ForwardBatch, worker)
    await h.start()
    return h


@pytest.mark.parametrize("prompt_step_ms", [None, 80.0])
def test_a_request_arriving_during_a_long_prompt_step_rides_in_the_next(
    prompt_step_ms: float | None,
) -> None:
    """A's 100-token prompt takes two steps of the 64-token budget. B arrives while the
    first runs; the second holds A's last 36 tokens and B's first 28."""
    asyncio.run(_arrives_during_a_prompt_step(prompt_step_ms))


async def _arrives_during_a_prompt_step(prompt_step_ms: float | None) -> None:
    worker = Worker()
    h = await _harness(worker)
    try:
        if prompt_step_ms is not None:  # an earlier prompt step took this long
            await h.send(_request("warm", 20, 5000), sender="tokenizer")
            worker.end(0, prompt_step_ms)
            await h.settle()
            await worker.drain(h, 5.0)  # its decodes
        await h.send(_request("A", 100, 1000), sender="tokenizer")
        assert worker.rids(0) == {"A"} and len(worker.batches) == 1  # nothing planned past it
        await h.send(_request("B", 90, 2000), sender="tokenizer")
        worker.end(0, 80.0)
        await h.settle()
        assert worker.rids(1) == {"A", "B"}
        assert sum(len(s.input_ids) for s in worker.batches[1].seqs) == BUDGET
    finally:
        for gate in worker.gates:
            gate.set()
        await h.stop()


def test_past_short_prompt_steps_and_decodes_the_next_step_is_planned_at_once() -> None:
    """Where prompt steps are short (under LONG_PROMPT_STEP_MS), and with decodes alone
    in flight, the next step goes to the worker while this one runs (overlap)."""
    asyncio.run(_short_prompt_steps())


async def _short_prompt_steps() -> None:
    worker = Worker()
    h = await _harness(worker)
    try:
        await h.send(_request("warm", 20, 5000), sender="tokenizer")
        worker.end(0, LONG_PROMPT_STEP_MS / 4)
        await h.settle()
        assert len(worker.batches) == 3  # its first decode, and the next one planned past it
        await h.send(_request("A", 100, 1000), sender="tokenizer")
        worker.end(1, 5.0)
        await h.settle()
        assert len(worker.batches) == 4 and worker.rids(3) == {"warm", "A"}
        worker.end(2, 5.0)  # step 3, with A's first chunk, now runs: planned past at once
        await h.settle()
        assert len(worker.batches) == 5 and "A" in worker.rids(4)
    finally:
        for gate in worker.gates:
            gate.set()
        await h.stop()
