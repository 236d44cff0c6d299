"""The prefix cache keyed by adapter: the same tokens under two adapters (or an adapter
and the base model) never share KV; requests of one adapter do; eviction, locks and
the in-batch prefix wait see every adapter's entries; HiCache keys differ too."""

from __future__ import annotations

import random
from pathlib import Path

from actorlm.actors.cache.hicache import HiCacheFile, page_keys
from actorlm.actors.cache.kv_cache import KVCacheManager
from actorlm.actors.cache.radix import RadixTree
from actorlm.actors.cache.step import HiCacheTier

PS = 2
PROMPT = [1, 2, 3, 4, 5, 6, 7]


def test_one_adapters_kv_never_serves_another() -> None:
    kv = KVCacheManager(32, PS)
    a = kv.admit("a", PROMPT, namespace="A")
    assert a is not None
    kv.finish("a", PROMPT + [8], cache=True)
    for rid, ns in (("base", ""), ("b", "B")):
        got = kv.admit(rid, PROMPT, namespace=ns)
        assert got is not None and got.cached_len == 0, ns
        assert not set(got.page_ids) & set(a.page_ids[:3])
    again = kv.admit("a2", PROMPT, namespace="A")  # the same adapter shares
    assert again is not None and again.cached_len == 6 and again.page_ids[:3] == a.page_ids[:3]
    kv.check_invariants()
    for rid in ("base", "b", "a2"):
        kv.finish(rid, PROMPT, cache=True)
    kv.check_invariants()
    # the same three pages three times over (A has a fourth: a's output token)
    assert kv.stats()["pages_cached"] == 10
    assert kv.flush().freed_pages == 10 and kv.tree.roots == [kv.tree.root]  # roots dropped
    kv.check_invariants()


def test_in_batch_prefix_waits_stay_within_an_adapter() -> None:
    kv = KVCacheManager(64, PS, wait_min_tokens=4)
    long = list(range(40))
    assert kv.admit("a", long, namespace="A") is not None
    assert kv.waits_for(long[:30] + [99], namespace="A") == "a"
    assert kv.waits_for(long[:30] + [99], namespace="B") is None
    assert kv.waits_for(long[:30] + [99]) is None


def test_eviction_ranks_every_namespace_together() -> None:
    tree = RadixTree(PS)
    tree.insert([1, 2], [10], namespace="A")
    tree.insert([1, 2], [11])
    tree.insert([1, 2], [12], namespace="B")
    hit = tree.match_prefix([1, 2, 3], namespace="A")
    assert hit.pages == [10]
    tree.lock(hit.node)
    assert tree.evict(2) == [11, 12]  # the locked one (A) stays, whatever its age
    tree.unlock(hit.node)
    assert tree.evict(1) == [10]
    tree.check()


def test_random_traffic_over_adapters_keeps_the_books() -> None:
    rng = random.Random(0)
    kv = KVCacheManager(40, PS)
    live: dict[str, list[int]] = {}
    for i in range(400):
        if live and rng.random() < 0.5:
            rid = rng.choice(sorted(live))
            ids = live.pop(rid)
            kv.finish(rid, ids, cache=rng.random() < 0.8)
        else:
            ns = rng.choice(["", "A", "B"])
            ids = [rng.randrange(3) for _ in range(rng.randint(1, 9))]
            if kv.admit(f"r{i}", ids, namespace=ns) is not None:
                live[f"r{i}"] = ids
        kv.check_invariants()


def test_hicache_keys_differ_per_adapter(tmp_path: Path) -> None:
    tier = HiCacheTier(HiCacheFile(tmp_path), "m")
    assert tier.key_model("") == "m"
    keys = {ns: page_keys(tier.key_model(ns), PROMPT, PS) for ns in ("", "A", "B")}
    assert len({tuple(k) for k in keys.values()}) == 3
