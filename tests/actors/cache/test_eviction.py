from __future__ import annotations

from typing import Any

import pytest
from actorlm.actors.cache.eviction import (
    EvictableNode,
    EvictionStrategy,
    LRUStrategy,
    make_strategy,
)
from actorlm.actors.cache.kv_cache import KVCacheManager
from actorlm.actors.cache.radix import RadixTree
from actorlm.extensions.points import EVICTION_POLICIES
from actorlm.extensions.registry import UnknownNameError

PS = 2
# Five one-page prompts, inserted in this order (creation order A < B < ... < E).
PROMPTS = {"A": [1, 1], "B": [2, 2], "C": [3, 3], "D": [4, 4], "E": [5, 5]}
PRIORITY = {"A": 1, "B": 0, "C": 1, "D": 2, "E": 0}
# Hits: A 3, B 2, C 1, D 0, E 1.  Last access: D (insert) < A < B < C < E.
LOOKUPS = ["A", "A", "A", "B", "B", "C", "E"]

EXPECTED = {
    "lru": "DABCE",  # ascending last access
    "lfu": "DCEBA",  # ascending hits, ties (C, E) by last access
    "fifo": "ABCDE",  # ascending creation
    "mru": "ECBAD",  # descending last access
    "filo": "EDCBA",  # descending creation
    "priority": "BEACD",  # ascending priority (B, E: 0; A, C: 1; D: 2), ties by last access
    "slru": "DCEAB",  # probationary (< 2 hits: D, C, E) by LRU, then protected (A, B) by LRU
}


def _eviction_order(policy: str) -> str:
    tree = RadixTree(PS, make_strategy(policy))
    page_to_name = {}
    for page, (name, tokens) in enumerate(PROMPTS.items()):
        tree.insert(tokens, [page], priority=PRIORITY[name])
        page_to_name[page] = name
    for name in LOOKUPS:
        assert tree.match_prefix(PROMPTS[name]).num_tokens == PS
    order = ""
    while tree.num_cached_pages:
        freed = tree.evict(1)
        assert len(freed) == 1
        order += page_to_name[freed[0]]
    tree.check()
    return order


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_policy_evicts_in_documented_order(policy: str) -> None:
    assert _eviction_order(policy) == EXPECTED[policy]


def test_every_builtin_is_registered() -> None:
    assert set(EXPECTED) <= set(EVICTION_POLICIES.names())
    for name in EXPECTED:
        assert EVICTION_POLICIES.entry(name).source == "builtin"
        strategy = make_strategy(name)
        assert isinstance(strategy, EvictionStrategy) and strategy.name == name
        assert strategy.__doc__


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match="lru"):
        make_strategy("nope")


def test_parent_is_evicted_only_after_its_children() -> None:
    tree = RadixTree(PS, LRUStrategy())
    tree.insert([1, 1, 2, 2], [0, 1])  # [1,1] becomes the parent after the split below
    tree.insert([1, 1, 3, 3], [2, 3])
    tree.insert([9, 9], [4])  # newest, but the oldest pages are in the shared branch
    assert tree.evict(1) == [1]
    assert tree.evict(1) == [3]
    assert tree.evict(1) == [0]  # parent became a leaf, LRU among the rest
    assert tree.evict(1) == [4]


def test_slru_threshold_is_configurable() -> None:
    class Node:
        def __init__(self, hits: int, t: int) -> None:
            self.hit_count, self.last_access_time = hits, t

    s = make_strategy(EVICTION_POLICIES.get("slru")(protected_threshold=3))
    hot, warm = Node(3, 1), Node(2, 2)
    assert s.priority(warm) < s.priority(hot)  # type: ignore[arg-type]


def test_plugin_policy_is_used_by_the_cache_manager() -> None:
    class BiggestPageFirst(EvictionStrategy):
        """Evicts the node holding the highest page id first (a test-only order)."""

        name = "test-biggest-page"

        def priority(self, node: EvictableNode) -> tuple[Any, ...]:
            return (-max(node.pages),)  # type: ignore[attr-defined]

    EVICTION_POLICIES.register("test-biggest-page", BiggestPageFirst, source="test")
    try:
        kv = KVCacheManager(4, PS, policy="test-biggest-page")
        for rid, tokens in [("a", [1, 1, 0]), ("b", [2, 2, 0])]:
            adm = kv.admit(rid, tokens)
            assert adm is not None
            kv.finish(rid, tokens[:2])  # page 0 (a) and page 2 (b) cached
        assert kv.allocator.num_free == 2
        assert kv.admit("c", [7] * 5) is not None  # needs 3 pages: evicts one node
        # LRU would drop a's older page; this policy drops b's (page 2 > page 0).
        assert kv.tree.match_prefix([1, 1], touch=False).pages == [0]
        assert kv.tree.match_prefix([2, 2], touch=False).pages == []
        kv.check_invariants()
    finally:
        EVICTION_POLICIES.unregister("test-biggest-page")
