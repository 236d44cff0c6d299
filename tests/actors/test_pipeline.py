"""The whole pipeline over real processes with a tiny random Llama (issue: serving pipeline)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from actorlm import Engine
from actorlm.actors.client import RequestFailed
from actorlm.actors.runtime.transport import free_port

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def greedy(n: int) -> dict[str, object]:
    return {**GREEDY, "max_new_tokens": n}


def _prompts(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, 49000) for _ in range(rng.randint(3, 120))], rng.randint(2, 20))
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[Engine]:
    # float32: compared with fp32 transformers (auto is bf16 on CPUs with native bf16)
    with Engine(str(tiny_llama), kv_cache_gb=0.05, max_prefill_tokens=256, dtype="float32") as eng:
        yield eng


@pytest.fixture(scope="module")
def alone(engine: Engine) -> dict[int, list[int]]:
    """Each prompt's greedy tokens when it runs by itself."""
    return {i: engine.generate(ids, greedy(n)).token_ids for i, (ids, n) in enumerate(_prompts(64))}


def _near_tie(model_dir: Path, ids: list[int], got: list[int], want: list[int]) -> bool:
    """True if the first divergence is a near-tie (top-2 logit gap < 1e-4) in transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    k = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + want[:k]])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1]) < 1e-4


def test_engine_matches_transformers_greedy(engine: Engine, tiny_llama: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ids, n = _prompts(1, seed=7)[0][0], 16
    out = engine.generate(ids, greedy(n))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ref = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    assert out.token_ids == ref[0, len(ids) :].tolist()
    assert out.finish_reason == "length" and out.usage.completion_tokens == n


def test_bad_sampling_is_refused_at_the_engine_edge(engine: Engine) -> None:
    with pytest.raises(RequestFailed, match="top_p must be in") as info:
        engine.generate([1, 2, 3], {"max_new_tokens": 2, "top_p": 0})
    assert info.value.status == 400
    with pytest.raises(RequestFailed, match="outside the vocabulary"):
        engine.generate([1, 2, 3], {"max_new_tokens": 2, "logit_bias": {10**6: 1.0}})
    assert engine.generate([1, 2, 3], greedy(2)).finish_reason == "length"  # still serving


def test_64_concurrent_requests_match_each_alone(
    engine: Engine, alone: dict[int, list[int]], tiny_llama: Path
) -> None:
    prompts = _prompts(64)

    async def run_all() -> list[list[int]]:
        tasks = [engine.agenerate(ids, greedy(n)) for ids, n in prompts]
        return [o.token_ids for o in await asyncio.gather(*tasks)]

    outs = asyncio.run(run_all())
    for i, (ids, _) in enumerate(prompts):
        if outs[i] != alone[i]:
            assert _near_tie(tiny_llama, ids, outs[i], alone[i]), (
                f"request {i} diverged without a near-tie"
            )


def test_shared_prefix_is_served_from_cache(engine: Engine) -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(100, 49000) for _ in range(160)]
    prompt = prefix + [rng.randrange(100, 49000) for _ in range(9)]
    assert engine.flush_cache()
    before = engine.stats()["scheduler"]["prefill_tokens"]
    cold = engine.generate(prompt, greedy(8))
    mid = engine.stats()["scheduler"]["prefill_tokens"]
    warm = engine.generate(prompt, greedy(8))
    after = engine.stats()["scheduler"]["prefill_tokens"]
    assert cold.token_ids == warm.token_ids
    assert mid - before == len(prompt)
    assert after - mid <= len(prompt) - 160  # the 10 full pages of the prefix were reused
    assert warm.usage.cached_tokens >= 160
    other = engine.generate(prefix + [5, 6, 7], greedy(4))
    assert other.usage.cached_tokens >= 144


def test_a_finished_request_has_returned_its_pages_when_its_client_hears(
    engine: Engine,
) -> None:
    # No polling: the scheduler tells the cache manager before it emits the last token,
    # so a flush right after generate() never finds the request's pages still in use.
    for i in range(10):
        engine.generate([300 + i] * 40, greedy(3))
        assert engine.flush_cache(), f"round {i}"


def test_prompts_arriving_together_compute_their_shared_prefix_once(engine: Engine) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(100, 49000) for _ in range(192)]  # 12 pages
    prompts = [prefix + [rng.randrange(100, 49000) for _ in range(5)] for _ in range(4)]
    alone = [engine.generate(p, greedy(4)).token_ids for p in prompts]
    assert engine.flush_cache()
    before = engine.stats()

    long_prompt = [1000 + i for i in range(1200)]  # keeps the steps busy while all 4 arrive

    async def together() -> list[Any]:
        jobs = [engine.agenerate(long_prompt, greedy(1))]
        jobs += [engine.agenerate(p, greedy(4)) for p in prompts]
        return list(await asyncio.gather(*jobs))[1:]

    outs = asyncio.run(together())
    after = engine.stats()
    assert [o.token_ids for o in outs] == alone
    computed = after["scheduler"]["prefill_tokens"] - before["scheduler"]["prefill_tokens"]
    # the prefix once, then each prompt's own tail
    assert computed == len(long_prompt) + len(prefix) + 4 * 5
    assert sorted(o.usage.cached_tokens for o in outs) == [0, 192, 192, 192]


def test_aborts_mid_prefill_and_mid_decode_return_every_page(engine: Engine) -> None:
    async def scenario() -> None:
        long_prompt = [1000 + i for i in range(1500)]
        decode = engine.stream([7, 8, 9], {**GREEDY, "max_new_tokens": 2000})
        first = await decode.__anext__()  # decoding now
        assert first.finish_reason is None
        prefill = engine.stream(long_prompt, {**GREEDY, "max_new_tokens": 5})
        task = asyncio.ensure_future(prefill.__anext__())
        await asyncio.sleep(0.05)  # 1500 tokens at 256 per step: still prefilling
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await decode.aclose()
        await prefill.aclose()

    asyncio.run(scenario())
    for _ in range(100):
        stats = engine.stats()
        if stats["scheduler"]["running"] == 0 and stats["cache_manager"]["pages_private"] == 0:
            break
        time.sleep(0.05)
    assert engine.flush_cache()
    cache = engine.stats()["cache_manager"]
    assert cache["pages_free"] == cache["pages_total"]


def test_small_kv_pool_forces_retraction_and_outputs_survive(
    tiny_llama: Path, alone: dict[int, list[int]]
) -> None:
    prompts = _prompts(64)[:12]
    # pages one at a time: with the CPU's runs of 8 these prompts are admitted fewer at
    # once and never need retracting
    options = {"num_pages": 24, "max_prefill_tokens": 256, "decode_page_run": 1}
    with Engine(str(tiny_llama), dtype="float32", **options) as small:
        outs = small.generate([ids for ids, _ in prompts], {**GREEDY, "max_new_tokens": 20})
        stats = small.stats()
    assert stats["scheduler"]["retractions"] > 0
    for i, out in enumerate(outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 20
        n = prompts[i][1]
        assert out.token_ids[:n] == alone[i][:n]


def test_overlap_on_and_off_give_the_same_tokens(tiny_llama: Path) -> None:
    """A mixed batch with chunked prefill (a small prefill budget), a small pool, stop
    tokens and aborts: overlap scheduling changes none of the tokens. (Retraction with
    and without overlap is driven step by step in tests/actors/scheduler/test_policy.py.)"""
    prompts = _prompts(64, seed=3)[:8]
    stops = list(range(100, 30000, 7))  # some requests stop early, with a step in flight

    async def run(eng: Engine) -> list[list[int]]:
        async def one(i: int, ids: list[int]) -> list[int]:
            params = {**GREEDY, "max_new_tokens": 16, "stop_token_ids": stops if i % 3 == 1 else []}
            if i % 4 == 3:  # aborted after a few tokens
                got: list[int] = []
                stream = eng.stream(ids, params)
                async for delta in stream:
                    got += delta.token_ids
                    if len(got) >= 3:
                        break
                await stream.aclose()
                return []
            return (await eng.agenerate(ids, params)).token_ids

        return list(await asyncio.gather(*(one(i, ids) for i, (ids, _) in enumerate(prompts))))

    outs, stats = [], []
    for disable in (True, False):
        options = dict(
            num_pages=10, max_prefill_tokens=32, disable_overlap_schedule=disable, dtype="float32"
        )
        with Engine(str(tiny_llama), **options) as eng:
            outs.append(asyncio.run(run(eng)))
            stats.append(eng.stats())
    assert outs[0] == outs[1]
    assert stats[1]["scheduler"]["zombies"] > 0  # the overlap run ended requests mid-flight
    assert stats[1]["scheduler"]["running"] == 0


def test_stream_interval_sends_tokens_n_at_a_time(engine: Engine, tiny_llama: Path) -> None:
    """--stream-interval 4: a stream's first delta carries one token, the others up to
    4, and the tokens, text and logprobs are the interval-1 engine's."""
    prompts = _prompts(6, seed=5)
    params = {**greedy(13), "logprobs": True}
    want = [engine.generate(ids, params) for ids, _ in prompts]

    async def run(eng: Engine) -> list[list[Any]]:
        async def one(ids: list[int]) -> list[Any]:
            return [d async for d in eng.stream(ids, params)]

        return list(await asyncio.gather(*(one(ids) for ids, _ in prompts)))

    with Engine(str(tiny_llama), kv_cache_gb=0.05, stream_interval=4, dtype="float32") as eng:
        streams = asyncio.run(run(eng))
    for deltas, ref in zip(streams, want, strict=True):
        sizes = [len(d.token_ids) for d in deltas if d.token_ids]
        assert sizes[0] == 1 and max(sizes) <= 4 and len(sizes) < 13
        assert [t for d in deltas for t in d.token_ids] == ref.token_ids
        assert "".join(d.text for d in deltas) == ref.text
        got = [lp for d in deltas for lp in (d.logprobs or [])]
        # the reference ran alone, these together: batched fp32 sums differ in the last bits
        assert [lp.logprob for lp in got] == pytest.approx(
            [lp.logprob for lp in ref.logprobs], abs=1e-4
        )


def test_killed_worker_fails_in_flight_requests_promptly(tiny_llama: Path) -> None:
    with Engine(str(tiny_llama), kv_cache_gb=0.05) as eng:
        launcher = eng._launcher
        assert launcher is not None

        async def scenario() -> float:
            stream = eng.stream([5, 6, 7], greedy(1500))
            await stream.__anext__()
            os.kill(launcher.members["worker"].pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(RequestFailed):
                async for delta in stream:
                    if delta.error:
                        raise RequestFailed(delta.error, delta.error_code)
            return time.monotonic() - start

        assert asyncio.run(scenario()) < 2.0
        with pytest.raises(RequestFailed):
            eng.generate([1, 2, 3], greedy(2))


def test_disaggregated_actors_over_tcp_from_one_deployment_file(
    tiny_llama: Path, tmp_path: Path, alone: dict[int, list[int]]
) -> None:
    roles = ["tokenizer", "scheduler", "cache_manager", "worker"]
    lines = [f'[model]\npath = "{tiny_llama}"\nkv_cache_gb = 0.05\ndtype = "float32"\n']
    for role in roles:
        lines.append(f'[actors.{role}]\naddress = "tcp://127.0.0.1:{free_port()}"\n')
    deploy = tmp_path / "cluster.toml"
    deploy.write_text("\n".join(lines))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "actorlm.cli", "actor", role, "--deploy", str(deploy)]
        )
        for role in roles
    ]
    try:
        with Engine(deploy=str(deploy), start_timeout=120) as eng:
            prompts = _prompts(64)[:16]
            outs = eng.generate([ids for ids, _ in prompts], {**GREEDY, "max_new_tokens": 20})
            for i, out in enumerate(outs):
                n = prompts[i][1]
                assert out.token_ids[:n] == alone[i][:n]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(20)
    assert all(p.returncode is not None for p in procs)
