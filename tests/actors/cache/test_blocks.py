"""The blocks a prefix tree reports (``CacheEvents`` for the router) are exactly the
pages it holds: a set kept by the events alone always equals the tree's contents."""

from __future__ import annotations

import itertools
import random

from actorlm.actors.cache.blocks import BlockEvents, block_hashes
from actorlm.actors.cache.radix import RadixTree, TreeNode
from hypothesis import given, settings
from hypothesis import strategies as st

PS = 4


def tree_blocks(tree: RadixTree) -> set[int]:
    """Every cached page's chained hash, from the tree's own contents."""
    out: set[int] = set()
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(c, ()) for c in tree.root.children.values()]
    while stack:
        node, above = stack.pop()
        path = above + node.key
        out.update(block_hashes(path, PS))
        stack.extend((c, path) for c in node.children.values())
    return out


def test_a_hash_names_its_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], PS)
    assert len(a) == 2  # the partial page is no block
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], PS) == a
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], PS)
    assert b[0] == a[0] and b[1] != a[1]
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], PS)
    assert c[1] != a[1]  # same page, another prefix: another block
    assert all(0 <= h < 2**63 for h in a + b + c)


def test_events_are_netted_and_reset_drops_the_past() -> None:
    ev = BlockEvents()
    assert not ev
    ev.stored([1, 2])
    ev.removed([2, 3])
    assert ev.take() == (False, [1], [2, 3])
    assert not ev
    ev.stored([4])
    ev.clear_all()
    ev.stored([5])
    assert ev.take() == (True, [5], [])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6))
def test_a_view_built_from_events_equals_the_tree(seed: int) -> None:
    rng = random.Random(seed)
    events = BlockEvents()
    tree = RadixTree(PS, events=events)
    view: set[int] = set()
    prompts: list[list[int]] = []
    ids = itertools.count()
    for _ in range(30):
        op = rng.random()
        if op < 0.6:
            base = rng.choice(prompts) if prompts and rng.random() < 0.7 else []
            cut = rng.randrange(0, len(base) + 1) // PS * PS
            tokens = base[:cut] + [rng.randrange(5) for _ in range(PS * rng.randint(1, 4))]
            match = tree.match_prefix(tokens)  # may split a node: no event
            fresh = len(tokens) // PS - len(match.pages)
            tree.insert(tokens, match.pages + [next(ids) for _ in range(fresh)])
            prompts.append(tokens)
        elif op < 0.9:
            tree.evict(rng.randint(1, 3))
        else:
            tree.flush()
        reset, stored, removed = events.take()
        assert not reset
        view.difference_update(removed)
        view.update(stored)
        assert view == tree_blocks(tree) == set(tree.cached_blocks())
        tree.check()


def test_an_untracked_tree_and_adapter_entries_record_nothing() -> None:
    plain = RadixTree(PS)
    plain.insert([1, 2, 3, 4], [0])
    assert plain.root.children[(1, 2, 3, 4)].hashes == []
    events = BlockEvents()
    tree = RadixTree(PS, events=events)
    tree.insert([1, 2, 3, 4], [0], namespace="adapter-1")
    assert not events  # a LoRA adapter's KV is no base-model block
    tree.insert([1, 2, 3, 4], [1])
    assert events.take() == (False, block_hashes([1, 2, 3, 4], PS), [])
