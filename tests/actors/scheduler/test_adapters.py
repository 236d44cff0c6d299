"""The scheduler's LoRA bookkeeping (``AdapterGate``) and the planner's adapter readiness:
a request is admitted only once its adapter is in a slot, references are released when
requests leave, and a step goes to the loader only when something changed."""

from __future__ import annotations

import msgspec
from actorlm.actors.scheduler.adapters import AdapterGate
from actorlm.actors.scheduler.policy import BatchPlanner
from actorlm.config import SchedulerConfig
from actorlm.messages.cache import Admitted, CacheStepResult
from actorlm.messages.generate import TokenizedRequest
from actorlm.messages.lora import LoraAcquired, LoraRefused, LoraStepResult
from actorlm.messages.sampling import SamplingParams


def tok(rid: str, lora: str = "") -> TokenizedRequest:
    return TokenizedRequest(
        rid=rid,
        input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=4),
        lora_path=lora or None,
    )


def planner() -> BatchPlanner:
    return BatchPlanner(SchedulerConfig(), page_size=4, num_pages=64, max_model_len=256)


def test_only_requests_whose_adapter_is_in_a_slot_are_admitted() -> None:
    p = planner()
    for rid, lora_id in (("base", ""), ("a1", "A"), ("b1", "B"), ("a2", "A")):
        assert p.add(msgspec.structs.replace(tok(rid), lora_id=lora_id), "tokenizer") is None
    p.ready_adapters = {"A"}
    step = p.cache_ops()
    assert step is not None
    assert [(a.rid, a.lora_id) for a in step.admits] == [("base", ""), ("a1", "A"), ("a2", "A")]
    p.apply_cache(CacheStepResult(admitted=[Admitted(a.rid, 0, [0]) for a in step.admits]))
    assert set(p.waiting) == {"b1"}
    p.ready_adapters = {"A", "B"}
    step = p.cache_ops()
    assert step is not None and [a.rid for a in step.admits] == ["b1"]


def test_gate_acquires_then_queues_and_releases_what_left() -> None:
    gate = AdapterGate()
    gate.add(tok("r1", "sql"), "tokenizer")
    gate.add(tok("r2", "nope"), "tokenizer")
    gate.add(tok("r3", "sql"), "tokenizer")
    step = gate.step([], [])
    assert step is not None and [(a.rid, a.name) for a in step.acquire] == [
        ("r1", "sql"),
        ("r2", "nope"),
        ("r3", "sql"),
    ]
    assert gate.abort("r3") is not None  # aborted while its acquire is in flight
    result = LoraStepResult(
        acquired=[LoraAcquired("r1", "ID"), LoraAcquired("r3", "ID")],
        refused=[LoraRefused("r2", "no such adapter")],
        ready=["OTHER"],
    )
    acquired, refused = gate.apply(result)
    assert [(m.rid, m.lora_id, to) for m, to in acquired] == [("r1", "ID", "tokenizer")]
    assert [(m.rid, no.message) for (m, _), no in refused] == [("r2", "no such adapter")]
    assert gate.ready == {"OTHER"} and set(gate.held) == {"r1", "r3"}
    gate.sweep(lambda rid: rid == "r1")  # r3 never joined the planner
    step = gate.step([], [])
    assert step is not None and step.release == ["r3"] and step.acquire == []
    assert gate.step([], []) is None  # nothing changed since
    gate.dirty = True  # the loader's slots changed
    assert gate.step([], []) is not None and gate.step([], []) is None


def test_gate_says_what_waiting_and_running_requests_need() -> None:
    gate = AdapterGate()
    p = planner()
    for rid, lora_id in (("w1", "B"), ("w2", "A"), ("w3", "B")):
        p.add(msgspec.structs.replace(tok(rid), lora_id=lora_id), "tokenizer")
        gate.held[rid] = lora_id
    step = gate.step(p.waiting.values(), p.running.values())
    assert step is not None and step.wanted == ["B", "A"] and step.in_use == []
    assert gate.step(p.waiting.values(), p.running.values()) is None
    p.ready_adapters = {"B"}
    ops = p.cache_ops()
    assert ops is not None
    p.apply_cache(CacheStepResult(admitted=[Admitted(a.rid, 0, [0]) for a in ops.admits]))
    step = gate.step(p.waiting.values(), p.running.values())
    assert step is not None and step.wanted == ["A"] and step.in_use == ["B"]


def test_stale_readiness_and_a_dead_loader() -> None:
    gate = AdapterGate()
    gate.add(tok("r1", "sql"), "tokenizer")
    gate.step([], [])
    acquired, _ = gate.apply(
        LoraStepResult(acquired=[LoraAcquired("r1", "ID")], ready=["ID"]), worker_known=False
    )
    assert gate.ready == set() and len(acquired) == 1  # loaded into a worker we do not know
    gate.add(tok("r2", "sql"), "tokenizer")
    gate.step([], [])
    gate.add(tok("r4", "sql"), "tokenizer")
    waiting, held = gate.reset()
    assert sorted(m.rid for m, _ in waiting) == ["r2", "r4"] and held == ["r1"]
    assert not (gate.pending or gate.sent or gate.held or gate.ready)
    gate.add(tok("r5", "sql"), "tokenizer")
    gate.step([], [])
    assert [m.rid for m, _ in gate.failed()] == ["r5"]  # the step never reached the loader
