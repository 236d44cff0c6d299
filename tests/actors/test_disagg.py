"""Prefill/decode disaggregation (``--prefill-replicas``) on real actors and ZMQ sockets
(inproc, one event loop): a decode replica hands long prompts to a prefill replica whose
worker ships the KV pages into the decode worker's pool. Greedy tokens and logprobs are
those of a single worker, with and without a cached prefix on either side."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from actorlm import Engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}
THRESHOLD = 16  # prompts with more uncached tokens than this are prefilled remotely


def greedy(n: int, **extra: object) -> dict[str, object]:
    return {**GREEDY, "max_new_tokens": n, **extra}


def _engine(model: Path, **options: Any) -> Engine:
    return Engine(str(model), placement="inproc", kv_cache_gb=0.02, dtype="float32", **options)


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> Iterator[dict[str, Engine]]:
    made: dict[str, Engine] = {}
    try:
        made["one"] = _engine(tiny_llama)
        made["pd"] = _engine(tiny_llama, prefill_replicas=1, max_local_prefill_tokens=THRESHOLD)
        yield made
    finally:
        for engine in made.values():
            engine.close()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def pd_stats(engine: Engine) -> dict[str, Any]:
    stats = engine.stats()
    out = {k: v for k, v in stats["scheduler"].items() if k.startswith("pd_")}
    out["sent"] = stats["worker.1"].get("kv_sent_bytes")  # None: down
    out["received"] = stats["worker"]["kv_received_bytes"]
    return out


def test_a_prompt_prefilled_elsewhere_gives_the_tokens_of_one_worker(
    engines: dict[str, Engine],
) -> None:
    one, pd = engines["one"], engines["pd"]
    rng = random.Random(1)
    prefix = _prompt(rng, 48)  # three pages
    prompts = [_prompt(rng, n) for n in (17, 40, 90, 250)]
    prompts += [prefix + _prompt(rng, 30), prefix + _prompt(rng, 60)]  # the second: cached
    params = greedy(12, logprobs=True, top_logprobs=3)
    before = pd_stats(pd)
    for prompt in prompts:
        want, got = one.generate(prompt, params), pd.generate(prompt, params)
        assert got.token_ids == want.token_ids
        # the first token's logprob and top alternatives came from the prefill replica
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t[1] for t in a.top] == [t[1] for t in b.top] and len(a.top) == 3
    after = pd_stats(pd)
    assert after["pd_remote_prefills"] - before["pd_remote_prefills"] == len(prompts)
    assert after["pd_transfer_failures"] == before["pd_transfer_failures"]
    assert after["received"] - before["received"] == after["sent"] - before["sent"] > 0
    # the last prompt found the shared prefix cached here: only its tail was shipped
    assert pd.generate(prefix + _prompt(rng, 30), greedy(1)).usage.cached_tokens == 48


def test_conditional_disaggregation_takes_both_branches(engines: dict[str, Engine]) -> None:
    pd = engines["pd"]
    rng = random.Random(2)
    long = _prompt(rng, 120)
    before = pd_stats(pd)
    pd.generate(_prompt(rng, THRESHOLD), greedy(4))  # short: prefilled on the decode worker
    mid = pd_stats(pd)
    assert mid["pd_local_prefills"] == before["pd_local_prefills"] + 1
    assert mid["pd_remote_prefills"] == before["pd_remote_prefills"]
    assert mid["sent"] == before["sent"]
    out = pd.generate(long, greedy(4))  # long: remote
    again = pd.generate(long[:-2] + [7, 8, 9], greedy(4))  # cached but for its tail: local
    after = pd_stats(pd)
    assert after["pd_remote_prefills"] == mid["pd_remote_prefills"] + 1
    assert after["pd_local_prefills"] == mid["pd_local_prefills"] + 1
    assert (
        again.usage.cached_tokens >= 112
        and out.token_ids == engines["one"].generate(long, greedy(4)).token_ids
    )


def test_a_prefill_replica_down_leaves_the_decode_replica_serving(tiny_llama: Path) -> None:
    engine = _engine(
        tiny_llama, prefill_replicas=1, max_local_prefill_tokens=0, restart_policy="never"
    )
    one = _engine(tiny_llama)
    try:
        rng = random.Random(3)
        prompts = [_prompt(rng, 64) for _ in range(2)]
        assert engine.generate(prompts[0], greedy(6)).token_ids == (
            one.generate(prompts[0], greedy(6)).token_ids
        )
        assert pd_stats(engine)["pd_remote_prefills"] == 1
        launcher = engine._launcher
        assert launcher is not None
        member = launcher.members["worker.1"]
        assert member.runtime is not None
        engine._loop.call_soon_threadsafe(member.runtime.stop)
        deadline = time.monotonic() + 20
        while pd_stats(engine)["sent"] is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        out = engine.generate(prompts[1], greedy(6))  # computed on the decode replica
        assert out.token_ids == one.generate(prompts[1], greedy(6)).token_ids
        stats = pd_stats(engine)
        assert stats["pd_remote_prefills"] == 1 and stats["pd_transfer_failures"] == 0
    finally:
        engine.close()
        one.close()


def test_two_decode_replicas_share_one_prefill_replica(
    tiny_llama: Path, engines: dict[str, Engine]
) -> None:
    engine = _engine(
        tiny_llama,
        dp_size=2,
        prefill_replicas=1,
        router_policy="round_robin",
        max_local_prefill_tokens=THRESHOLD,
    )
    try:
        rng = random.Random(4)
        prompts = [_prompt(rng, 60) for _ in range(4)]
        got = [engine.generate(p, greedy(8)).token_ids for p in prompts]
        assert got == [engines["one"].generate(p, greedy(8)).token_ids for p in prompts]
        stats = engine.stats()
        assert stats["tokenizer"]["router_routed"] == [2, 2]  # the prefill replica: never
        assert [stats[s]["pd_remote_prefills"] for s in ("scheduler", "scheduler.1")] == [2, 2]
        assert stats["worker.2"]["kv_sent_bytes"] == sum(
            stats[w]["kv_received_bytes"] for w in ("worker", "worker.1")
        )
    finally:
        engine.close()


def test_aborts_at_any_point_of_a_remote_prefill_leave_no_page_behind(
    engines: dict[str, Engine],
) -> None:
    import asyncio
    import contextlib

    pd, one = engines["pd"], engines["one"]
    rng = random.Random(5)
    prompts = [_prompt(rng, rng.randint(40, 200)) for _ in range(16)]
    waits = [rng.choice([0.0, 0.001, 0.005, 0.02, 0.05, None]) for _ in prompts]

    async def leave_early(prompt: list[int], wait: float | None) -> None:
        async def read() -> None:
            async for _ in pd.stream(prompt, greedy(24)):
                pass

        if wait is None:  # this one runs to its end
            await read()
            return
        # the client goes away: before, during or after the prompt's transfer
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(read(), wait)

    async def run() -> None:
        await asyncio.gather(*(leave_early(p, w) for p, w in zip(prompts, waits, strict=True)))

    asyncio.run(run())
    deadline = time.monotonic() + 20
    while True:  # aborts land asynchronously: every page comes back
        stats = pd.stats()
        caches = [stats[c] for c in ("cache_manager", "cache_manager.1")]
        if stats["scheduler"]["pd_remote_in_flight"] == 0 and all(
            c["consistent"] and c["pages_private"] == 0 for c in caches
        ):
            break
        assert time.monotonic() < deadline, (stats["scheduler"], caches)
        time.sleep(0.1)
    assert stats["scheduler"]["pd_remote_prefills"] > 0
    prompt = _prompt(rng, 90)  # and it serves on, right
    assert pd.generate(prompt, greedy(8)).token_ids == one.generate(prompt, greedy(8)).token_ids
    # the worker forgets the transfers of the aborted with the next step's releases
    assert pd.stats()["worker"]["kv_expected"] == 0
