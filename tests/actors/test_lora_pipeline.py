"""LoRA through the whole engine (real processes: tokenizer, scheduler, cache manager,
worker and lora_loader) against ``peft`` on the same adapter files: alone and in
batches that mix adapters with each other and with the base model, with fewer slots
than adapters; the prefix cache per adapter; adapters loaded, used, unloaded and
loaded again while other requests stream; an unload that waits for its request."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from actorlm import Engine
from actorlm.actors.client import RequestFailed

from ..gpu.helpers import hf_model

PROMPTS = {
    None: [5, 17, 923, 4, 4, 88, 1200, 31, 7],
    "sql": list(range(100, 141)),
    "chat": [42, 42, 7, 19000, 3, 8, 12],
    "all": [9, 8, 7, 6, 5, 4, 3, 2, 1, 300],
    "sparse": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
}
N = 10


def greedy(n: int = N, **kw: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": n, **kw}


@torch.inference_mode()
def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int = N) -> Any:
    """``peft``'s greedy tokens and their log-probabilities."""
    from peft import PeftModel

    model = hf_model(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    ids, logprobs = list(prompt), []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        tok = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
    return ids[len(prompt) :], logprobs


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, lora_adapters: dict[str, Path]) -> Iterator[Engine]:
    paths = [f"sql={lora_adapters['sql']}", f"chat={lora_adapters['chat']}"]
    with Engine(
        str(tiny_llama),
        kv_cache_gb=0.05,
        quantization="none",  # fp32 throughout, as peft computes
        dtype="float32",
        lora_paths=paths,
        max_loras_per_batch=2,  # fewer slots than adapters: they take turns
        max_lora_rank=16,
        max_prefill_tokens=256,
    ) as eng:
        eng.load_lora_adapter("all", str(lora_adapters["all"]))
        eng.load_lora_adapter("sparse", str(lora_adapters["sparse"]))
        yield eng


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, lora_adapters: dict[str, Path]) -> dict[str | None, Any]:
    return {
        name: peft_greedy(tiny_llama, lora_adapters.get(name) if name else None, prompt)
        for name, prompt in PROMPTS.items()
    }


async def _together(engine: Engine, jobs: list[tuple[str | None, list[int]]], **kw: Any) -> Any:
    return await asyncio.gather(*(engine.agenerate(p, greedy(**kw), lora=name) for name, p in jobs))


def test_each_adapter_alone_matches_peft(engine: Engine, reference: dict[str | None, Any]) -> None:
    for name, prompt in PROMPTS.items():
        out = engine.generate(prompt, greedy(logprobs=True), lora=name)
        tokens, logprobs = reference[name]
        assert out.token_ids == tokens, name
        got = [lp.logprob for lp in out.logprobs]
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-3, name
    assert reference["sql"][0] != reference[None][0]  # the adapter changes the output


def test_mixed_batches_with_fewer_slots_than_adapters_match_peft(
    engine: Engine, reference: dict[str | None, Any]
) -> None:
    """Five adapters and the base model at once, twice over, through two slots: requests
    wait for their adapter's turn and none deadlocks, whatever runs beside it."""
    before = engine.stats()["lora_loader"]["slot_evictions"]
    jobs = [(name, prompt) for name, prompt in PROMPTS.items()] * 2
    outs = asyncio.run(_together(engine, jobs))
    for (name, _), out in zip(jobs, outs, strict=True):
        assert out.token_ids == reference[name][0], name
    stats = engine.stats()
    assert stats["lora_loader"]["slot_evictions"] > before
    # the references go at the scheduler's next adapter round, after the last outputs
    deadline = time.monotonic() + 10
    while stats["lora_loader"]["adapter_refs"] or stats["scheduler"]["lora_requests"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
        stats = engine.stats()


def test_the_prefix_cache_never_shares_kv_across_adapters(
    engine: Engine, tiny_llama: Path, lora_adapters: dict[str, Path]
) -> None:
    prompt = list(range(2000, 2060))  # several full pages
    first = engine.generate(prompt, greedy(4), lora="sql")
    other = engine.generate(prompt, greedy(4), lora="chat")
    base = engine.generate(prompt, greedy(4))
    again = engine.generate(prompt, greedy(4), lora="sql")
    assert first.usage.cached_tokens == 0
    assert other.usage.cached_tokens == 0 and base.usage.cached_tokens == 0
    assert again.usage.cached_tokens >= 48 and again.token_ids == first.token_ids
    assert other.token_ids == peft_greedy(tiny_llama, lora_adapters["chat"], prompt, 4)[0]
    assert base.token_ids == peft_greedy(tiny_llama, None, prompt, 4)[0]
    assert engine.stats()["cache_manager"]["consistent"]


def _stream_in_thread(engine: Engine, prompt: list[int], n: int, lora: str | None) -> Any:
    """A long generation running in a thread; ``.first`` is set at its first token."""
    box: dict[str, Any] = {}
    first = threading.Event()

    async def consume() -> None:
        tokens: list[int] = []
        async for delta in engine.stream(prompt, greedy(n), lora=lora):
            tokens.extend(delta.token_ids)
            if tokens:
                first.set()
            if delta.finish_reason:
                box["finish"], box["error"] = delta.finish_reason, delta.error
        box["tokens"] = tokens
        box["ended"] = time.monotonic()

    thread = threading.Thread(target=lambda: asyncio.run(consume()), daemon=True)
    thread.start()
    thread.first, thread.box = first, box  # type: ignore[attr-defined]
    return thread


def test_load_use_unload_reload_while_others_stream(
    engine: Engine, lora_adapters: dict[str, Path], reference: dict[str | None, Any]
) -> None:
    base = _stream_in_thread(engine, PROMPTS[None], 800, None)
    sql = _stream_in_thread(engine, PROMPTS["sql"], 800, "sql")
    assert base.first.wait(60) and sql.first.wait(60)
    for _ in range(2):
        assert base.is_alive() and sql.is_alive()  # still streaming meanwhile
        info = engine.load_lora_adapter("again", str(lora_adapters["chat"]))
        assert info["rank"] == 8 and "again" in {a["name"] for a in engine.lora_adapters()}
        assert (
            engine.generate(PROMPTS["chat"], greedy(), lora="again").token_ids
            == (reference["chat"][0])
        )
        engine.unload_lora_adapter("again")
        with pytest.raises(RequestFailed, match="'again' does not exist") as gone:
            engine.generate(PROMPTS["chat"], greedy(2), lora="again")
        assert gone.value.status == 404
    base.join(120)
    sql.join(120)
    for stream, name in ((base, None), (sql, "sql")):
        assert stream.box["finish"] == "length" and len(stream.box["tokens"]) == 800
        assert stream.box["tokens"][:N] == reference[name][0]


def test_an_unload_waits_for_the_request_using_the_adapter(
    engine: Engine, lora_adapters: dict[str, Path]
) -> None:
    engine.load_lora_adapter("busy", str(lora_adapters["sparse"]))
    stream = _stream_in_thread(engine, PROMPTS["sparse"], 1000, "busy")
    assert stream.first.wait(60)
    done: dict[str, float] = {}
    unload = threading.Thread(
        target=lambda: (engine.unload_lora_adapter("busy"), done.setdefault("t", time.monotonic()))
    )
    unload.start()
    deadline = time.monotonic() + 10
    while "busy" in {a["name"] for a in engine.lora_adapters()}:  # hidden at once...
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert stream.is_alive() and "t" not in done  # ...while the request runs on
    with pytest.raises(RequestFailed, match="'busy' does not exist"):
        engine.generate(PROMPTS["sparse"], greedy(2), lora="busy")
    stream.join(120)
    unload.join(60)
    assert stream.box["finish"] == "length" and len(stream.box["tokens"]) == 1000
    assert done["t"] >= stream.box["ended"] - 0.05
    assert "busy" not in {a["name"] for a in engine.lora_adapters()}


def test_refusals_are_clear(engine: Engine, tiny_llama: Path) -> None:
    with pytest.raises(RequestFailed, match="'nope' does not exist.*adapters: all, chat") as info:
        engine.generate([1, 2, 3], greedy(2), lora="nope")
    assert info.value.status == 404
    with pytest.raises(RequestFailed, match="not a directory") as bad:
        engine.load_lora_adapter("x", str(tiny_llama / "config.json"))
    assert bad.value.status == 400
    assert engine.generate([1, 2, 3], greedy(2), lora="sql").finish_reason == "length"
