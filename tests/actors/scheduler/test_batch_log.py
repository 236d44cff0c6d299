"""The scheduler's SGLang-style batch lines (``actors/scheduler/batch_log.py``): what
each line counts, when the decode line comes, and its generation throughput."""

from __future__ import annotations

import logging

import pytest
from actorlm.actors.scheduler.batch_log import BatchLog
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import ForwardBatch, SeqInit, SeqResult, SeqStep, StepResult

LOGGER = "actorlm.actors.scheduler.batch_log"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _prompt(rid: str, ids: list[int], cached: int) -> SeqStep:
    init = SeqInit(
        sampling=SamplingParams(), token_ids=[0] * cached + ids, prompt_len=cached + len(ids)
    )
    return SeqStep(rid, ids, cached, [0], True, init)


def _decode(rid: str, pos: int) -> SeqStep:
    return SeqStep(rid, [7], pos, [0])


def _result(batch: ForwardBatch, ms: float) -> StepResult:
    sampled = [SeqResult(s.rid, 1) for s in batch.seqs if s.sample]
    return StepResult(step_id=batch.step_id, results=sampled, forward_ms=ms)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_step_with_prompt_tokens_logs_a_prefill_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = BatchLog(40, capacity_tokens=1000)
    # a new prompt of 5 tokens over 32 cached, a later chunk of another (no init), a decode
    chunk = SeqStep("b", [1, 2, 3], 64, [0], False)
    batch = ForwardBatch(
        step_id=1, seqs=[_prompt("a", [1, 2, 3, 4, 5], 32), chunk, _decode("c", 9)]
    )
    log.step(batch, _result(batch, 12.34), kv_tokens=[37, 67, 10], running=3, queued=2)
    assert _lines(caplog) == [
        "Prefill batch. #new-seq: 1, #new-token: 8, #cached-token: 32, token usage: 0.11, "
        "#running-req: 3, #queue-req: 2, step: 12.3 ms"
    ]


def test_a_decode_line_every_interval_steps_with_the_throughput_since_the_last(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    log = BatchLog(3, capacity_tokens=400, clock=clock)
    clock.now += 50.0  # idle since start-up: not in the first window
    decodes = ForwardBatch(step_id=1, seqs=[_decode("a", 10), _decode("b", 20)])
    for ms in (10.0, 20.0):
        clock.now += ms / 1e3
        log.step(decodes, _result(decodes, ms), kv_tokens=[11, 21], running=2, queued=0)
    assert _lines(caplog) == []  # 2 of 3 decode steps
    # a prefill step counts its sampled token, not as a decode step
    prompt = ForwardBatch(step_id=2, seqs=[_prompt("c", [1, 2], 0)])
    clock.now += 0.030
    log.step(prompt, _result(prompt, 30.0), kv_tokens=[11, 21, 2], running=3, queued=0)
    caplog.clear()
    clock.now += 0.040
    log.step(decodes, _result(decodes, 40.0), kv_tokens=[12, 22, 2], running=3, queued=1)
    # 7 tokens sampled in the 0.1 s since the first step was sent; steps 10, 20, 40 ms
    assert _lines(caplog) == [
        "Decode batch. #running-req: 3, #token: 36, token usage: 0.09, "
        "gen throughput (token/s): 70.00, #queue-req: 1, step: 23.3 ms"
    ]
    caplog.clear()
    for _ in range(2):
        log.step(decodes, _result(decodes, 5.0), kv_tokens=[12, 22], running=2, queued=0)
    assert _lines(caplog) == []  # counting again from 0


def test_interval_zero_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = BatchLog(0, capacity_tokens=100)
    for batch in (
        ForwardBatch(step_id=1, seqs=[_prompt("a", [1, 2], 0)]),
        ForwardBatch(step_id=2, seqs=[_decode("a", 2)]),
    ):
        log.step(batch, _result(batch, 1.0), kv_tokens=[3], running=1, queued=0)
    assert _lines(caplog) == []
