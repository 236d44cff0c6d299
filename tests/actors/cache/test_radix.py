from __future__ import annotations

import pytest
from actorlm.actors.cache.radix import RadixTree
from hypothesis import given, settings
from hypothesis import strategies as st

PS = 2


def test_match_empty_tree() -> None:
    t = RadixTree(PS)
    m = t.match_prefix([1, 2, 3])
    assert (m.num_tokens, m.pages, m.node) == (0, [], t.root)
    assert t.hit_rate == 0.0


def test_match_returns_longest_full_page_prefix() -> None:
    t = RadixTree(PS)
    assert t.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]).redundant == []
    assert t.match_prefix([1, 2, 3, 4, 5, 6, 7]).pages == [10, 11, 12]
    assert t.match_prefix([1, 2, 3, 4, 5]).pages == [10, 11]  # partial page never matches
    assert t.match_prefix([1, 2, 3, 9, 5, 6]).pages == [10]  # mismatch inside page 2
    assert t.match_prefix([2, 2]).pages == []
    m = t.match_prefix([1, 2, 3, 4])
    assert m.num_tokens == 4 and m.node.pages == [11]  # split on the page boundary
    t.check()
    assert t.num_cached_pages == 3


def test_hit_rate_counts_tokens() -> None:
    t = RadixTree(PS)
    t.insert([1, 2, 3, 4], [0, 1])
    t.match_prefix([1, 2, 3, 4, 5, 6])  # 4 of 6
    t.match_prefix([7, 8])  # 0 of 2
    assert t.hit_rate == pytest.approx(4 / 8)
    t.match_prefix([1, 2], touch=False)  # not a lookup
    assert t.lookups == 2


def test_insert_dedups_pages_already_cached() -> None:
    t = RadixTree(PS)
    t.insert([1, 2, 3, 4], [10, 11])
    r = t.insert([1, 2, 3, 4, 5, 6], [20, 21, 22])
    assert r.redundant == [20, 21]
    assert r.pages == [10, 11, 22]
    # The same ids again are not redundant: the tree already owns them.
    assert t.insert([1, 2, 3, 4], [10, 11]).redundant == []
    assert sorted(t.cached_pages()) == [10, 11, 22]
    t.check()


def test_insert_branches_and_splits() -> None:
    t = RadixTree(PS)
    t.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    r = t.insert([1, 2, 3, 4, 7, 8], [5, 6, 7])
    assert r.redundant == [5, 6] and r.pages == [0, 1, 7]
    assert t.match_prefix([1, 2, 3, 4, 7, 8]).pages == [0, 1, 7]
    assert t.match_prefix([1, 2, 3, 4, 5, 6]).pages == [0, 1, 2]
    assert t.num_cached_pages == 4
    t.check()


def test_insert_requires_full_pages() -> None:
    t = RadixTree(PS)
    with pytest.raises(ValueError):
        t.insert([1, 2, 3], [0, 1])


def test_locked_pages_survive_eviction_and_flush() -> None:
    t = RadixTree(PS)
    t.insert([1, 2, 3, 4], [0, 1])
    t.insert([5, 6], [2])
    node = t.match_prefix([1, 2, 3, 4]).node
    t.lock(node)
    assert (t.num_evictable_pages, t.num_locked_pages) == (1, 2)
    assert t.evict(10) == [2]
    assert t.flush() == []
    assert t.num_cached_pages == 2
    t.unlock(node)
    assert t.num_evictable_pages == 2
    assert sorted(t.flush()) == [0, 1]
    assert t.num_cached_pages == 0
    t.check()


def test_lock_survives_split_of_locked_node() -> None:
    t = RadixTree(PS)
    t.insert([1, 2, 3, 4], [0, 1])
    node = t.match_prefix([1, 2, 3, 4]).node
    t.lock(node)
    t.insert([1, 2, 9, 9], [5, 6])  # splits the locked node's edge
    t.check()
    assert t.evict(10) == [6]
    t.unlock(node)
    assert t.num_evictable_pages == 2
    t.check()


def test_unlock_of_unlocked_raises() -> None:
    t = RadixTree(PS)
    r = t.insert([1, 2], [0])
    with pytest.raises(RuntimeError):
        t.unlock(r.node)
    t.check()


def test_evict_parent_after_children() -> None:
    t = RadixTree(PS)
    t.insert([1, 2, 3, 4], [0, 1])
    t.insert([1, 2, 5, 6], [2, 3])  # root -> [1,2] -> {[3,4], [5,6]}
    freed = t.evict(3)
    assert sorted(freed) == [0, 1, 3]  # both leaves, then their parent
    assert t.num_cached_pages == 0
    t.check()


def _cached_prefixes(t: RadixTree) -> dict[tuple[int, ...], int]:
    """Every cached full-page prefix -> the page id holding its last page (plus the empty one)."""
    out: dict[tuple[int, ...], int] = {(): -1}
    stack = [(t.root, ())]
    while stack:
        node, prefix = stack.pop()
        for i, page in enumerate(node.pages):
            out[prefix + node.key[: (i + 1) * PS]] = page
        full = prefix + node.key
        stack.extend((c, full) for c in node.children.values())
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=8),
    st.lists(st.integers(0, 3), max_size=12),
)
def test_match_is_longest_common_full_page_prefix(seqs: list[list[int]], query: list[int]) -> None:
    t = RadixTree(PS)
    next_page = 0
    for seq in seqs:
        seq = seq[: len(seq) - len(seq) % PS]
        t.insert(seq, list(range(next_page, next_page + len(seq) // PS)))
        next_page += len(seq) // PS
    best = 0
    for seq in seqs:
        k = 0
        while k + PS <= min(len(seq), len(query)) and seq[k : k + PS] == query[k : k + PS]:
            k += PS
        best = max(best, k)
    m = t.match_prefix(query)
    assert m.num_tokens == best and len(m.pages) == best // PS
    t.check()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "lock", "unlock", "evict", "match"]),
            st.lists(st.integers(0, 2), min_size=0, max_size=10),
            st.integers(0, 4),
        ),
        max_size=40,
    )
)
def test_random_operations_keep_tree_consistent(ops: list[tuple[str, list[int], int]]) -> None:
    t = RadixTree(PS)
    next_page = 0
    owned: set[int] = set()  # pages the tree has taken
    locked: list = []
    for op, tokens, n in ops:
        tokens = tokens[: len(tokens) - len(tokens) % PS]
        if op == "insert":
            pages = list(range(next_page, next_page + len(tokens) // PS))
            next_page += len(pages)
            r = t.insert(tokens, pages)
            assert set(r.redundant) <= set(pages)
            owned |= set(pages) - set(r.redundant)
            assert t.match_prefix(tokens, touch=False).pages == r.pages
        elif op == "lock":
            m = t.match_prefix(tokens)
            t.lock(m.node)
            locked.append((m.node, list(m.pages)))
        elif op == "unlock" and locked:
            node, _ = locked.pop(n % len(locked))
            t.unlock(node)
        elif op == "evict":
            freed = t.evict(n)
            protected = {p for _, pages in locked for p in pages}
            assert not set(freed) & protected, "evicted a locked page"
            assert set(freed) <= owned
            owned -= set(freed)
        else:
            m = t.match_prefix(tokens)
            prefixes = _cached_prefixes(t)
            expect = max(k for k in range(0, len(tokens) + 1, PS) if tuple(tokens[:k]) in prefixes)
            assert m.num_tokens == expect
            assert m.pages == [prefixes[tuple(tokens[: (i + 1) * PS])] for i in range(expect // PS)]
        t.check()
        assert set(t.cached_pages()) == owned
        for _, pages in locked:  # a locked prefix stays cached under the same ids
            assert set(pages) <= owned
