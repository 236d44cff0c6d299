"""Data-parallel replicas behind the router (``dp_size=2``), each replica a scheduler,
cache manager and worker of its own, every actor on real ZMQ sockets (inproc, one
event loop: these engines start in well under a second)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from actorlm import Engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def greedy(n: int) -> dict[str, object]:
    return {**GREEDY, "max_new_tokens": n}


def _engine(model: Path, **options: Any) -> Engine:
    return Engine(str(model), placement="inproc", kv_cache_gb=0.02, dtype="float32", **options)


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> Iterator[dict[str, Engine]]:
    made: dict[str, Engine] = {}
    try:
        made["one"] = _engine(tiny_llama)
        made["round_robin"] = _engine(tiny_llama, dp_size=2, router_policy="round_robin")
        made["least_load"] = _engine(tiny_llama, dp_size=2, router_policy="least_load")
        # cache_aware is the default; loads differing by 3 are unbalanced already
        made["cache_aware"] = _engine(tiny_llama, dp_size=2, router_balance_abs=2)
        yield made
    finally:
        for engine in made.values():
            engine.close()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def router(engine: Engine) -> dict[str, Any]:
    return engine.stats()["tokenizer"]


def test_two_replicas_give_the_tokens_of_one(engines: dict[str, Engine]) -> None:
    rng = random.Random(1)
    prompts = [_prompt(rng, rng.randint(3, 90)) for _ in range(6)]
    want = [engines["one"].generate(p, greedy(12)).token_ids for p in prompts]
    two = engines["round_robin"]
    assert [two.generate(p, greedy(12)).token_ids for p in prompts] == want
    assert router(two)["router_routed"] == [3, 3]  # both replicas computed some
    assert "router_policy" not in router(engines["one"])  # one replica: no router at all
    assert set(engines["one"].stats()) == {"tokenizer", "scheduler", "cache_manager", "worker"}


def _shared_prefix_run(engine: Engine) -> tuple[list[int], list[int]]:
    """Two 10-page prefixes, each asked for 4 times (A A B B A A B B): the cached tokens
    of each request, and the replica each prefix's requests went to."""
    assert engine.flush_cache()
    rng = random.Random(2)
    prefixes = [_prompt(rng, 160), _prompt(rng, 160)]
    cached, routed = [], []
    for which in [0, 0, 1, 1, 0, 0, 1, 1]:
        before = router(engine)["router_routed"]
        out = engine.generate(prefixes[which] + _prompt(rng, 5), greedy(2))
        after = router(engine)["router_routed"]
        routed.append(next(r for r in range(2) if after[r] > before[r]))
        cached.append(out.usage.cached_tokens)
    return cached, routed


def test_repeats_of_a_prefix_go_to_the_replica_that_cached_it(
    engines: dict[str, Engine],
) -> None:
    engine = engines["cache_aware"]
    cached, routed = _shared_prefix_run(engine)
    # A starts on replica 0; B, on neither, on the least loaded with the smaller cache: 1
    assert routed == [0, 0, 1, 1, 0, 0, 1, 1]
    assert cached[0] == cached[2] == 0 and all(
        c >= 160 for i, c in enumerate(cached) if i not in (0, 2)
    )
    stats = engine.stats()
    assert stats["tokenizer"]["router_decisions"]["cache"] == 6
    for cm in ("cache_manager", "cache_manager.1"):  # each replica's own hits, 3 of 4
        assert stats[cm]["prefix_matched_tokens"] >= 3 * 160
    # the router's view of each cache is what the cache holds
    blocks = stats["tokenizer"]["router_cached_blocks"]
    assert blocks == [
        stats["cache_manager"]["pages_cached"],
        stats["cache_manager.1"]["pages_cached"],
    ]

    rr_cached, rr_routed = _shared_prefix_run(engines["round_robin"])
    assert rr_routed == [0, 1, 0, 1, 0, 1, 0, 1]
    # each prefix is computed on both replicas: two misses more than cache_aware's
    assert sum(c == 0 for c in rr_cached) == 4 and sum(rr_cached) < sum(cached)


def _burst(engine: Engine, prompts: list[list[int]], n: int) -> list[Any]:
    async def run() -> list[Any]:
        return await asyncio.gather(*(engine.agenerate(p, greedy(n)) for p in prompts))

    return asyncio.run(run())


def test_a_saturated_replica_sheds_load(engines: dict[str, Engine]) -> None:
    engine = engines["cache_aware"]
    assert engine.flush_cache()
    rng = random.Random(3)
    prefix = _prompt(rng, 160)
    engine.generate(prefix + [7], greedy(1))  # replica 0 caches it
    before = router(engine)
    # eight at once: after three on replica 0 (cached), 3 - 0 > 2 and 3 > 1.5 x 0
    outs = _burst(engine, [prefix + _prompt(rng, 4) for _ in range(8)], 48)
    after = router(engine)
    got = [a - b for a, b in zip(after["router_routed"], before["router_routed"], strict=True)]
    assert got[1] >= 2 and got[0] >= 3, got
    assert after["router_decisions"]["balance"] > before["router_decisions"]["balance"]
    assert all(o.usage.completion_tokens == 48 for o in outs)
    assert after["router_load"] == [0, 0]

    least = engines["least_load"]
    before = router(least)["router_routed"]
    _burst(least, [prefix + _prompt(rng, 4) for _ in range(8)], 8)
    after = router(least)["router_routed"]
    assert [a - b for a, b in zip(after, before, strict=True)] == [4, 4]


def test_a_restarted_tokenizer_learns_every_cache_again(engines: dict[str, Engine]) -> None:
    import time

    engine = engines["cache_aware"]
    rng = random.Random(4)
    engine.generate(_prompt(rng, 100), greedy(2))
    stats = engine.stats()
    held = [stats["cache_manager"]["pages_cached"], stats["cache_manager.1"]["pages_cached"]]
    assert sum(held) > 0
    launcher = engine._launcher
    assert launcher is not None
    member = launcher.members["tokenizer"]
    old = member.incarnation
    assert member.runtime is not None
    # it stops (an exit the launcher did not ask for: a death); the launcher starts a new
    # one, whose router knows nothing
    engine._loop.call_soon_threadsafe(member.runtime.stop)
    deadline = time.monotonic() + 20
    while member.incarnation in (0, old) or not member.ready.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    while router(engine)["router_cached_blocks"] != held:  # each cache manager told it all
        assert time.monotonic() < deadline, router(engine)
        time.sleep(0.05)
