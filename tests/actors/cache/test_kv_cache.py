from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from actorlm.actors.cache.kv_cache import KVCacheManager
from hypothesis import event, given, settings
from hypothesis import strategies as st

PS = 2


def test_second_request_reuses_the_first_ones_pages() -> None:
    kv = KVCacheManager(8, PS)
    a = kv.admit("a", [1, 2, 3, 4, 5])
    assert a is not None and a.cached_len == 0 and len(a.page_ids) == 3
    kv.finish("a", [1, 2, 3, 4, 5, 6])  # three full pages go to the tree
    assert kv.stats()["pages_cached"] == 3
    b = kv.admit("b", [1, 2, 3, 4, 9])
    assert b is not None and b.cached_len == 4 and b.page_ids[:2] == a.page_ids[:2]
    assert kv.stats()["prefix_hit_rate"] == pytest.approx(4 / 10)
    kv.check_invariants()
    kv.release("b")
    kv.check_invariants()


def test_at_least_one_token_is_left_to_compute() -> None:
    kv = KVCacheManager(8, PS)
    kv.admit("a", [1, 2, 3, 4])
    kv.finish("a", [1, 2, 3, 4])
    b = kv.admit("b", [1, 2, 3, 4])
    assert b is not None and b.cached_len == 2 and len(b.page_ids) == 2
    kv.check_invariants()


def test_refused_admission_changes_nothing() -> None:
    kv = KVCacheManager(4, PS)
    kv.admit("a", [1, 2, 3, 4, 5])  # 3 pages
    before = kv.stats()
    assert kv.admit("b", [7, 7, 7, 7], extra_pages=1) is None
    assert kv.stats() == before and "b" not in kv
    kv.check_invariants()


def test_admission_evicts_unlocked_cache_but_not_running_prefixes() -> None:
    kv = KVCacheManager(4, PS)
    kv.admit("a", [1, 2, 3, 4, 0])
    kv.finish("a", [1, 2, 3, 4])  # 2 cached pages, 2 free
    b = kv.admit("b", [1, 2, 3, 4, 5])  # shares 2 pages (locked), takes 1
    assert b is not None and b.cached_len == 4
    assert kv.admit("c", [9, 9, 9]) is None  # needs 2, only 1 free and nothing evictable
    assert kv.extend("b", 1) is not None
    assert kv.extend("b", 1) is None
    kv.release("b")
    assert kv.admit("c", [9, 9, 9, 9, 9, 9, 9]) is not None  # 4 pages: evicts the prefix
    assert kv.stats()["pages_cached"] == 0
    kv.check_invariants()


def test_more_pages_come_as_one_run_while_a_quarter_of_the_pool_stays_available() -> None:
    """``more_pages`` (a decode's next pages, asked for with the one it needs) come
    with the needed ones, consecutive ids, while a quarter of the pool is left free or
    evictable after; where it is tighter only the needed pages, and a refusal is
    still all or nothing."""
    kv = KVCacheManager(32, PS)
    a = kv.admit("a", [1, 2, 3])  # 2 pages, then 3 more (as apply_step asks)
    assert a is not None and a.page_ids == [0, 1] and kv.extend("a", 0, 3) == [2, 3, 4]
    assert kv.extend("a", 1, more_pages=3) == [5, 6, 7, 8]
    b = kv.admit("b", list(range(10, 40)))  # 15 pages of 23: 3 more would leave 5, not 8
    assert b is not None and b.page_ids == list(range(9, 24)) and kv.extend("b", 0, 3) == []
    assert kv.extend("b", 1, more_pages=3) == [24]
    kv.finish("a", [1, 2, 3, 4])  # its pages past the tokens go back
    assert kv.stats()["pages_private"] == 16  # b's alone
    kv.check_invariants()
    tight = KVCacheManager(4, PS)
    tight.admit("c", [1, 2, 3, 4, 5, 6])
    assert tight.extend("c", 2, more_pages=3) is None and tight.page_table("c") == [0, 1, 2]
    tight.check_invariants()


def test_disabled_prefix_cache_never_shares() -> None:
    kv = KVCacheManager(6, PS, enable_prefix_cache=False)
    kv.admit("a", [1, 2, 3])
    kv.finish("a", [1, 2, 3, 4])
    b = kv.admit("b", [1, 2, 3])
    assert b is not None and b.cached_len == 0
    assert kv.cache_prefix("b", [1, 2, 3]) == b.page_ids
    kv.finish("b", [1, 2, 3, 4])
    assert kv.stats()["pages_free"] == 6 and kv.stats()["pages_cached"] == 0
    kv.check_invariants()


def test_finish_without_cache_frees_everything_private() -> None:
    kv = KVCacheManager(6, PS)
    kv.admit("a", [1, 2, 3, 4, 5], extra_pages=2)
    kv.finish("a", [1, 2, 3, 4, 5], cache=False)
    assert kv.stats()["pages_free"] == 6
    kv.check_invariants()


def test_concurrent_duplicates_share_after_cache_prefix() -> None:
    kv = KVCacheManager(8, PS)
    a = kv.admit("a", [1, 2, 3, 4, 5])
    b = kv.admit("b", [1, 2, 3, 4, 5])  # nothing cached yet: own pages
    assert a is not None and b is not None and not set(a.page_ids) & set(b.page_ids)
    table_a = kv.cache_prefix("a", [1, 2, 3, 4, 5])
    assert table_a == a.page_ids
    table_b = kv.cache_prefix("b", [1, 2, 3, 4, 5])
    assert table_b[:2] == a.page_ids[:2] and table_b[2] == b.page_ids[2]
    assert kv.stats()["pages_free"] == 8 - 4  # b's duplicate pages were returned
    kv.check_invariants()
    kv.finish("a", [1, 2, 3, 4, 5, 6])
    kv.finish("b", [1, 2, 3, 4, 5, 7])
    kv.check_invariants()
    assert kv.flush() == (4, 0)


def test_flush_reports_pages_in_use() -> None:
    kv = KVCacheManager(8, PS)
    kv.admit("a", [1, 2, 3, 4, 5])
    kv.finish("a", [1, 2, 3, 4, 5, 6])
    kv.admit("b", [1, 2, 3])  # locks one page
    freed, in_use = kv.flush()
    assert (freed, in_use) == (2, 1)
    kv.check_invariants()


def test_release_is_idempotent_and_unknown_ids_raise_elsewhere() -> None:
    kv = KVCacheManager(4, PS)
    kv.admit("a", [1, 2, 3])
    assert kv.release("a") and not kv.release("a")
    with pytest.raises(KeyError):
        kv.extend("a", 1)
    with pytest.raises(KeyError):
        kv.finish("a", [1, 2])
    with pytest.raises(ValueError):
        kv.admit("x", [])
    kv.admit("b", [1])
    with pytest.raises(ValueError):
        kv.admit("b", [1])


def test_finish_with_tokens_that_contradict_the_prefix_is_refused() -> None:
    kv = KVCacheManager(8, PS)
    kv.admit("a", [1, 2, 3])
    kv.finish("a", [1, 2, 3, 4])
    kv.admit("b", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError):
        kv.finish("b", [9, 9, 9, 9, 9, 9])
    assert "b" in kv  # nothing changed; the caller can still release it
    kv.release("b")
    kv.check_invariants()


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["admit", "decode", "finish", "finish_nocache", "abort", "commit", "flush"]
        ),
        st.integers(0, 5),
        st.lists(st.integers(0, 2), min_size=1, max_size=9),
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    OPS, st.sampled_from(["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]), st.booleans()
)
def test_random_workloads_keep_every_page_accounted_for(
    ops: list[tuple[str, int, list[int]]], policy: str, sharing: bool
) -> None:
    _run_workload(ops, policy, sharing, note=event)


@pytest.mark.parametrize("policy", ["lru", "slru", "priority"])
def test_long_seeded_workload(policy: str) -> None:
    rng = random.Random(policy)
    names = ["admit", "admit", "decode", "finish", "finish", "finish_nocache", "abort", "commit"]
    ops = [
        (
            rng.choice(names),
            rng.randrange(6),
            [rng.randrange(3) for _ in range(rng.randrange(1, 10))],
        )
        for _ in range(3000)
    ]
    _run_workload(ops + [("flush", 0, [0])], policy, True)


def _run_workload(
    ops: list[tuple[str, int, list[int]]],
    policy: str,
    sharing: bool,
    note: Callable[[str], None] = lambda _: None,
) -> None:
    kv = KVCacheManager(10, PS, policy=policy, enable_prefix_cache=sharing)
    # What each page holds, as the worker would have written it: page -> tokens so far.
    content: dict[int, list[int]] = {}
    running: dict[str, list[int]] = {}  # rid -> tokens whose KV is in its pages
    serial = 0

    def write(rid: str, start: int) -> None:
        table = kv.page_table(rid)
        for pos in range(start, len(running[rid])):
            page = table[pos // PS]
            content[page] = content.get(page, [])[: pos % PS] + [running[rid][pos]]

    def assert_pages_hold_tokens(rid: str, table: list[int], upto: int) -> None:
        for i in range(upto // PS):
            assert content[table[i]] == running[rid][i * PS : (i + 1) * PS], "wrong KV shared"

    for op, n, tokens in ops:
        rids = sorted(running)
        rid = rids[n % len(rids)] if rids else None
        if op == "admit":
            new = f"r{serial}"
            serial += 1
            cached_before = kv.stats()["pages_cached"]
            # A few shared system prompts, so prefixes repeat and the cache fills up.
            tokens = [[], [7, 7, 7], [7, 7, 8, 8, 9]][n % 3] + tokens
            adm = kv.admit(new, tokens, extra_pages=n % 2, priority=n)
            note("admit refused" if adm is None else "admitted")
            if kv.stats()["pages_cached"] < cached_before:
                note("admission evicted")
            if adm is not None:
                if adm.cached_len:
                    note("prefix reused")
                running[new] = list(tokens)
                assert_pages_hold_tokens(new, adm.page_ids, adm.cached_len)
                assert len(adm.page_ids) >= -(-len(tokens) // PS)
                write(new, adm.cached_len)
        elif rid is None:
            pass
        elif op == "decode":
            need = -(-(len(running[rid]) + n) // PS) - len(kv.page_table(rid))
            if need <= 0 or kv.extend(rid, need) is not None:
                start = len(running[rid])
                running[rid].extend(tokens[:1] * n)
                write(rid, start)
        elif op == "commit":
            table = kv.cache_prefix(rid, running[rid])
            assert_pages_hold_tokens(rid, table, len(running[rid]))
        elif op in ("finish", "finish_nocache"):
            kv.finish(rid, running.pop(rid), cache=op == "finish")
        elif op == "abort":
            assert kv.release(rid)
            del running[rid]
        else:
            freed, in_use = kv.flush()
            assert in_use <= kv.stats()["pages_used"]
        kv.check_invariants()
        s = kv.stats()
        assert s["pages_free"] + s["pages_private"] + s["pages_cached"] == s["pages_total"]
    for rid in list(running):
        kv.release(rid)
    kv.flush()
    assert kv.stats()["pages_free"] == 10


def test_a_prompt_waits_for_a_shared_prefix_being_computed() -> None:
    kv = KVCacheManager(64, PS, wait_min_tokens=4)
    system = list(range(100, 110))  # 10 tokens: 5 pages
    assert kv.admit("a", [*system, 1, 2]) is not None
    assert kv.waits_for([*system, 3, 4, 5]) == "a"  # 10 shared tokens, none cached
    assert kv.waits_for([*system[:3], 7, 7, 7, 7]) is None  # 2 shared: below the threshold
    assert kv.waits_for([9, *system]) is None  # a different first page
    kv.check_invariants()
    kv.cache_prefix("a", [*system, 1, 2])  # a's prefill is done and cached
    assert kv.waits_for([*system, 3, 4, 5]) is None
    b = kv.admit("b", [*system, 3, 4, 5])
    assert b is not None and b.cached_len == 10
    # b computes only its own tail: nothing there for a third prompt to wait for
    assert kv.waits_for([*system, 3, 4, 6, 6]) is None
    kv.check_invariants()


def test_nobody_waits_for_a_finished_or_released_prompt() -> None:
    kv = KVCacheManager(64, PS, wait_min_tokens=4)
    prompt = list(range(100, 112))
    for end in ("finish", "release"):
        kv.admit("a", prompt)
        assert kv.waits_for(prompt) == "a"
        if end == "finish":
            kv.finish("a", prompt, cache=False)
        else:
            kv.release("a")
        assert kv.waits_for(prompt) is None
        kv.check_invariants()
    disabled = KVCacheManager(64, PS, enable_prefix_cache=False, wait_min_tokens=4)
    disabled.admit("a", prompt)
    assert disabled.waits_for(prompt) is None  # nothing would be shared anyway
