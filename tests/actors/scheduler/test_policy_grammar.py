"""Constrained requests in the policy: held without a slot or a page until their
grammar is ready, failed alone when it cannot be, and eos always ends them."""

from __future__ import annotations

import random

from actorlm.actors.cache.step import apply_step
from actorlm.actors.scheduler.policy import BatchPlanner
from actorlm.config import SchedulerConfig
from actorlm.messages.errors import ErrorCode
from actorlm.messages.generate import TokenizedRequest
from actorlm.messages.sampling import SamplingParams
from actorlm.messages.step import SeqResult, StepResult

from .test_policy import PAGE, make, request, run


def constrained(rid: str, prompt: list[int], n: int) -> TokenizedRequest:
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, regex="[0-9]+")
    return TokenizedRequest(rid=rid, input_ids=prompt, sampling=sp, eos_token_ids=[2])


def test_a_held_request_takes_no_slot_and_blocks_no_one() -> None:
    cfg = SchedulerConfig(max_running_requests=1, max_prefill_tokens=24)
    planner = BatchPlanner(cfg, page_size=PAGE, num_pages=64, max_model_len=4096)
    assert planner.add(constrained("c", [1, 2, 3], 4), "t") is None
    assert planner.add(request("free", [4, 5, 6], 4), "t") is None
    assert "c" in planner.compiling and "c" not in planner.waiting
    ops = planner.cache_ops()
    assert ops is not None and [a.rid for a in ops.admits] == ["free"]  # the one slot
    assert planner.grammar_ready("c", "xgrammar")
    assert "c" in planner.waiting and planner.compiling == {}
    assert not planner.grammar_ready("c", "xgrammar")  # only once


def test_held_requests_end_alone_on_failure_or_abort() -> None:
    planner, kv = make(64)
    for rid in ("bad", "gone", "ok"):
        planner.add(constrained(rid, [7, 8, 9], 3), "t")
    planner.add(request("free", [1, 2, 3], 3), "t")
    planner.grammar_failed("bad", "invalid regex: ...", ErrorCode.INVALID_REQUEST)
    assert planner.abort("gone")
    (failed, aborted) = planner.take_deltas()
    assert (
        failed.rid == "bad"
        and failed.finish_reason == "error"
        and failed.error_code is ErrorCode.INVALID_REQUEST
    )
    assert aborted.rid == "gone" and aborted.finish_reason == "abort"
    planner.grammar_ready("ok", "llguidance")
    outputs = run(planner, kv, random.Random(0), 0.0)
    assert set(outputs) >= {"free"} and planner.compiling == {}
    kv.flush()
    assert kv.allocator.num_free == 64


def test_eos_ends_a_constrained_request_even_with_ignore_eos() -> None:
    planner, kv = make(64)
    planner.add(constrained("c", [1, 2], 10), "t")
    planner.grammar_ready("c", "xgrammar")
    planner.apply_cache(apply_step(kv, planner.cache_ops()).result)
    batch = planner.build_batch(1)
    (delta,) = planner.on_result(batch, StepResult(step_id=1, results=[SeqResult("c", 2)]))
    assert delta.finish_reason == "stop" and delta.grammar_backend == "xgrammar"
