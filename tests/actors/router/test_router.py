"""The router's policies and books, step by step (pure: no processes)."""

from __future__ import annotations

import pytest
from actorlm.actors.cache.blocks import block_hashes
from actorlm.actors.router.core import Router
from actorlm.actors.router.policies import (
    CacheAwarePolicy,
    ReplicaView,
    RouteRequest,
)
from actorlm.config import EngineConfig, ModelConfig, RouterConfig
from actorlm.messages.cache import CacheEvents

PS = 4


def router(policy: str = "", dp: int = 2, **settings: object) -> Router:
    cfg = EngineConfig(
        model=ModelConfig(page_size=PS),
        router=RouterConfig(dp_size=dp, router_policy=policy, **settings),  # type: ignore[arg-type]
    )
    return Router(cfg)


def cache(r: Router, replica: int, tokens: list[int]) -> None:
    role = "cache_manager" if replica == 0 else f"cache_manager.{replica}"
    r.on_events(role, CacheEvents(stored=block_hashes(tokens, PS)))


PROMPT = list(range(100, 117))  # 4 full pages and one token


def test_cache_aware_follows_the_cached_prefix() -> None:
    r = router()
    cache(r, 1, PROMPT[:16])
    assert r.route("a", PROMPT) == "scheduler.1"
    assert r.route("b", PROMPT) == "scheduler.1"  # load 1 vs 0: balanced enough
    assert r.stats()["router_load"] == [0, 2]
    # a prompt nobody holds goes to the least loaded
    assert r.route("c", list(range(500, 520))) == "scheduler"
    r.finish("a")
    r.finish("a")  # once only
    assert r.stats()["router_load"] == [1, 1]


def test_below_the_threshold_the_least_loaded_takes_it() -> None:
    r = router(router_cache_threshold=0.9)
    cache(r, 1, PROMPT[:8])  # 8 of 17 tokens
    r.route("x", [1] * 9)  # load replica 0... it is the least loaded (smaller cache)
    assert r.stats()["router_load"] == [1, 0]
    assert r.route("a", PROMPT) == "scheduler.1"  # by load, not by the short match
    r2 = router(router_cache_threshold=0.4)
    cache(r2, 1, PROMPT[:8])
    assert r2.route("a", PROMPT) == "scheduler.1"  # 8/17 >= 0.4: by cache


def test_unbalanced_loads_go_to_the_shortest_queue() -> None:
    policy = CacheAwarePolicy(RouterConfig(router_balance_abs=2, router_balance_rel=1.5))
    req = RouteRequest("a", 16)

    def views(loads: tuple[int, int]) -> list[ReplicaView]:
        return [ReplicaView(0, loads[0], 0, 0), ReplicaView(1, loads[1], 16, 4)]

    assert policy.choose(req, views((0, 2))) == 1  # differ by 2: not more than abs
    assert policy.choose(req, views((0, 3))) == 0  # by 3 > 2 and 3 > 1.5 x 0
    assert policy.choose(req, views((4, 7))) == 0  # 3 > 2 and 7 > 1.5 x 4
    assert policy.choose(req, views((10, 13))) == 1  # 3 > 2 but 13 < 1.5 x 10: the cache wins
    assert policy.decisions == {"cache": 2, "balance": 2, "load": 0}


def test_round_robin_and_least_load() -> None:
    r = router("round_robin", dp=3)
    cache(r, 0, PROMPT[:16])
    assert [r.route(str(i), PROMPT) for i in range(4)] == [
        "scheduler", "scheduler.1", "scheduler.2", "scheduler",
    ]  # fmt: skip
    r = router("least_load", dp=2)
    assert [r.route(str(i), PROMPT) for i in range(3)] == ["scheduler", "scheduler.1", "scheduler"]
    r.finish("1")
    assert r.route("3", PROMPT) == "scheduler.1"


def test_a_replica_with_a_member_down_takes_nothing() -> None:
    r = router()
    cache(r, 1, PROMPT[:16])
    assert r.route("a", PROMPT) == "scheduler.1"
    assert r.member_down("worker.1") == []  # its scheduler fails what ran there
    assert r.route("b", PROMPT) == "scheduler"
    r.member_up("worker.1")
    assert r.route("c", PROMPT) == "scheduler.1"
    assert sorted(r.member_down("scheduler.1")) == ["a", "c"]  # ended with it
    assert r.stats()["router_load"] == [1, 0]
    r.member_down("scheduler")
    assert r.route("d", PROMPT) is None
    r.member_up("scheduler")
    r.member_up("scheduler.1")
    r.member_down("cache_manager.1")  # its successor starts empty
    r.member_up("cache_manager.1")
    assert r.stats()["router_cached_blocks"] == [0, 0]


def test_events_reset_and_remove() -> None:
    r = router()
    cache(r, 1, PROMPT[:16])
    hashes = block_hashes(PROMPT[:16], PS)
    r.on_events("cache_manager.1", CacheEvents(removed=hashes[2:]))
    assert r.stats()["router_cached_blocks"] == [0, 2]
    r.on_events("cache_manager.1", CacheEvents(reset=True, stored=hashes[:1]))
    assert r.stats()["router_cached_blocks"] == [0, 1]
    r.on_events("worker.1", CacheEvents(stored=hashes))  # only cache managers say
    r.on_events("cache_manager.7", CacheEvents(stored=hashes))
    assert r.stats()["router_cached_blocks"] == [0, 1]


def test_a_policy_choosing_a_replica_that_is_down_is_an_error() -> None:
    class Wrong(CacheAwarePolicy):
        def choose(self, request: RouteRequest, replicas: object) -> int:
            return 1

    r = router()
    r.policy = Wrong(RouterConfig())
    r.member_down("worker.1")
    with pytest.raises(ValueError, match="chose replica 1"):
        r.route("a", PROMPT)


def test_a_draining_replica_takes_nothing_new_until_it_is_back() -> None:
    r = router("round_robin")
    assert r.route("a", PROMPT) == "scheduler"
    assert r.drain(0) == 1  # its load: "a" still runs there
    assert [r.route(rid, PROMPT) for rid in "bcd"] == ["scheduler.1"] * 3
    r.finish("a")
    assert r.drain(0) == 0 and r.stats()["router_draining"] == [0]
    with pytest.raises(ValueError, match="last one"):
        r.drain(1)  # nothing would take requests
    with pytest.raises(ValueError, match="no replica 2"):
        r.drain(2)
    assert r.drain(0, False) == 0 and r.stats()["router_draining"] == []
    assert {r.route(rid, PROMPT) for rid in "ef"} == {"scheduler", "scheduler.1"}
    # the cache-aware policy never picks a draining replica, even the one that cached it
    aware = router()
    cache(aware, 1, PROMPT[:16])
    aware.drain(1)
    assert aware.route("g", PROMPT) == "scheduler"
