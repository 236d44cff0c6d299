"""Radix tree over token ids at page granularity: the prefix cache's index.

Each edge holds a whole number of pages (``page_size`` tokens each) and one page
id per page; only full pages are cached, so every split and match lands on a
page boundary and a matched prefix is always directly usable as page-table
entries. Children are keyed by the tokens of their first page.

Reference counts (``lock``/``unlock``) protect the pages of running requests:
locking a node locks its whole path to the root, so the locked set is closed
under "ancestor of", and everything unlocked is evictable leaf by leaf.

The tree never frees pages itself: ``insert`` returns the pages it did not need
and ``evict``/``flush`` return the pages they dropped, and the caller hands them
back to the allocator.

Entries are keyed by adapter as well as by tokens: each ``namespace`` (a LoRA
adapter's id; "" for the base model) has a root of its own, so the same tokens
under two adapters are two entries and a match never crosses from one to the other
(their KV differs). Eviction ranks the leaves of every namespace together. A root
has no parent; an empty adapter root is dropped when its last leaf is.

Given ``events`` (data-parallel replicas: the router learns each cache from them), the
base model's nodes also carry each page's chained block hash (``blocks``), and every
page that enters or leaves the tree is recorded there.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from .blocks import ROOT_HASH, BlockEvents, block_hashes
from .eviction import EvictionStrategy, LRUStrategy

__all__ = ["InsertResult", "PrefixMatch", "RadixTree", "TreeNode"]


class TreeNode:
    """One edge of the tree: ``key`` tokens (a multiple of page_size) and their pages."""

    __slots__ = (
        "children",
        "creation_time",
        "hashes",
        "hit_count",
        "id",
        "key",
        "last_access_time",
        "lock_ref",
        "pages",
        "parent",
        "priority",
    )

    def __init__(
        self,
        node_id: int,
        key: tuple[int, ...],
        pages: list[int],
        parent: TreeNode | None,
        now: int,
    ) -> None:
        self.id = node_id  # creation sequence: the deterministic tie-breaker for eviction
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = 0
        self.hashes: list[int] = []  # per page, when the tree records block events

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, pages={self.pages}, lock_ref={self.lock_ref})"


class PrefixMatch(NamedTuple):
    num_tokens: int  # matched tokens, a multiple of page_size
    pages: list[int]  # one page id per matched page, in order
    node: TreeNode  # deepest matched node (the root when nothing matched); lock this


class InsertResult(NamedTuple):
    redundant: list[int]  # given pages the tree already had under another id: free them
    pages: list[int]  # the tree's page ids for the whole inserted key, in order
    node: TreeNode  # deepest node of the inserted key


class RadixTree:
    """Page-granular radix tree with ref counts and pluggable eviction."""

    def __init__(
        self,
        page_size: int,
        strategy: EvictionStrategy | None = None,
        events: BlockEvents | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.strategy = strategy or LRUStrategy()
        self.events = events
        self._clock = itertools.count(1)  # logical time: deterministic, unlike the wall clock
        self._ids = itertools.count()
        self.root = TreeNode(next(self._ids), (), [], None, 0)  # the base model's namespace
        self._roots: dict[str, TreeNode] = {"": self.root}
        self.num_cached_pages = 0
        self.num_evictable_pages = 0  # pages in unlocked nodes
        self.lookups = 0
        self.requested_tokens = 0
        self.matched_tokens = 0

    # ---- lookup -------------------------------------------------------------

    def root_of(self, namespace: str, *, create: bool = False) -> TreeNode | None:
        """The root of ``namespace``'s entries (made when ``create``)."""
        root = self._roots.get(namespace)
        if root is None and create:
            root = self._roots[namespace] = TreeNode(next(self._ids), (), [], None, 0)
        return root

    @property
    def roots(self) -> list[TreeNode]:
        return list(self._roots.values())

    def match_prefix(
        self, token_ids: Sequence[int], *, touch: bool = True, namespace: str = ""
    ) -> PrefixMatch:
        """Longest cached full-page prefix of ``token_ids``.

        May split a node so the match ends exactly on a node boundary (so locking
        the returned node protects exactly the matched pages). With ``touch`` the
        lookup counts toward the hit rate and marks the path as used now; the cache
        manager passes ``touch=False`` when it may still back out of an admission.
        """
        tokens = tuple(token_ids)
        ps = self.page_size
        root = self.root_of(namespace)
        if root is None:  # nothing cached for it: its root is made by the first insert
            root = TreeNode(-1, (), [], None, 0)
        node, pos, pages = root, 0, []
        limit = len(tokens) - len(tokens) % ps
        while pos < limit:
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                break
            k = self._common_pages(child.key, tokens, pos)
            if k < len(child.pages):
                child = self._split(child, k)
            pages.extend(child.pages)
            pos += k * ps
            node = child
        if touch:
            self.touch(node)
            self.record_lookup(len(tokens), pos)
        return PrefixMatch(pos, pages, node)

    def touch(self, node: TreeNode) -> None:
        """Mark ``node`` and its ancestors as just hit by a prefix lookup."""
        now = next(self._clock)
        while node.parent is not None:
            node.last_access_time = now
            node.hit_count += 1
            node = node.parent

    def record_lookup(self, requested_tokens: int, matched_tokens: int) -> None:
        self.lookups += 1
        self.requested_tokens += requested_tokens
        self.matched_tokens += matched_tokens

    @property
    def hit_rate(self) -> float:
        """Matched tokens / requested tokens over all recorded lookups."""
        return self.matched_tokens / self.requested_tokens if self.requested_tokens else 0.0

    # ---- insert -------------------------------------------------------------

    def insert(
        self,
        token_ids: Sequence[int],
        page_ids: Sequence[int],
        *,
        priority: int = 0,
        namespace: str = "",
    ) -> InsertResult:
        """Cache ``token_ids`` (exactly ``len(page_ids)`` full pages) backed by ``page_ids``.

        Where the tree already holds a page for the same prefix under a different
        id, the given id is returned in ``redundant`` (identical KV, computed twice)
        and the tree keeps its own; all other given pages now belong to the tree.
        """
        tokens = tuple(token_ids)
        ps = self.page_size
        if len(tokens) != len(page_ids) * ps:
            raise ValueError(
                f"insert needs {len(page_ids)} full pages = {len(page_ids) * ps} tokens, "
                f"got {len(tokens)}"
            )
        now = next(self._clock)
        node, pos = self.root_of(namespace, create=True), 0
        assert node is not None
        redundant: list[int] = []
        tree_pages: list[int] = []
        while pos < len(tokens):
            first = tokens[pos : pos + ps]
            child = node.children.get(first)
            if child is None:
                child = TreeNode(
                    next(self._ids), tokens[pos:], list(page_ids[pos // ps :]), node, now
                )
                node.children[first] = child
                if self.events is not None and not namespace:
                    parent = node.hashes[-1] if node.hashes else ROOT_HASH
                    child.hashes = block_hashes(child.key, ps, parent)
                    self.events.stored(child.hashes)
                self.num_cached_pages += len(child.pages)
                self.num_evictable_pages += len(child.pages)
                k = len(child.pages)
            else:
                k = self._common_pages(child.key, tokens, pos)
                if k < len(child.pages):
                    child = self._split(child, k)
                given = page_ids[pos // ps : pos // ps + k]
                redundant.extend(g for g, t in zip(given, child.pages, strict=True) if g != t)
            child.last_access_time = now
            child.priority = max(child.priority, priority)
            tree_pages.extend(child.pages)
            pos += k * ps
            node = child
        return InsertResult(redundant, tree_pages, node)

    # ---- reference counts ----------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its path to the root from eviction (one more reference)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.num_evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Drop one reference taken by ``lock(node)``."""
        cur = node
        while cur.parent is not None:  # check first so a bad unlock changes nothing
            if cur.lock_ref <= 0:
                raise RuntimeError(f"unlock of unlocked node {cur!r}")
            cur = cur.parent
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable_pages += len(node.pages)
            node = node.parent

    @property
    def num_locked_pages(self) -> int:
        return self.num_cached_pages - self.num_evictable_pages

    # ---- eviction -----------------------------------------------------------

    def evict(self, num_pages: int) -> list[int]:
        """Drop unlocked leaves, in the strategy's order, until ``num_pages`` pages are
        freed or nothing evictable is left; returns the dropped page ids.

        Whole nodes are dropped, so this may return more than asked. A parent that
        becomes an unlocked leaf joins the candidates.
        """
        freed: list[int] = []
        if num_pages <= 0:
            return freed
        # Rebuilt per call: eviction runs only under memory pressure, and a scan keeps
        # the tree free of a second index that every insert/split/lock must maintain.
        heap = [self._heap_entry(n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        while heap and len(freed) < num_pages:
            victim = heapq.heappop(heap)[2]
            parent = victim.parent
            assert parent is not None
            freed.extend(self._remove_leaf(victim))
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, self._heap_entry(parent))
        return freed

    def flush(self) -> list[int]:
        """Drop every unlocked node; locked paths (running requests) stay."""
        return self.evict(self.num_evictable_pages)

    # ---- introspection -------------------------------------------------------

    def stats(self) -> dict[str, float]:
        return {
            "pages_cached": self.num_cached_pages,
            "pages_evictable": self.num_evictable_pages,
            "pages_locked": self.num_locked_pages,
            "prefix_lookups": self.lookups,
            "prefix_requested_tokens": self.requested_tokens,
            "prefix_matched_tokens": self.matched_tokens,
            "prefix_hit_rate": self.hit_rate,
        }

    def cached_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def cached_blocks(self) -> list[int]:
        """Every base-model page's block hash (with ``events``; else none)."""
        return [h for n in self._nodes() for h in n.hashes]

    def check(self) -> None:
        """Raise AssertionError if the tree's bookkeeping is inconsistent (tests)."""
        cached = evictable = 0
        seen: set[int] = set()
        assert self._roots[""] is self.root
        for n in self._nodes():
            assert n.pages and len(n.key) == len(n.pages) * self.page_size, n
            assert n.parent is not None and n.parent.children[n.key[: self.page_size]] is n, n
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), n
            assert not seen.intersection(n.pages), f"page cached twice in {n!r}"
            seen.update(n.pages)
            cached += len(n.pages)
            evictable += len(n.pages) if n.lock_ref == 0 else 0
        assert cached == self.num_cached_pages, (cached, self.num_cached_pages)
        assert evictable == self.num_evictable_pages, (evictable, self.num_evictable_pages)

    # ---- internals -----------------------------------------------------------

    def _nodes(self) -> Iterator[TreeNode]:
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _heap_entry(self, node: TreeNode) -> tuple[tuple[Any, ...], int, TreeNode]:
        return (self.strategy.priority(node), node.id, node)

    def _common_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """Number of leading full pages of ``key`` equal to ``tokens[pos:]``."""
        ps = self.page_size
        n = min(len(key), len(tokens) - pos) // ps
        for i in range(n):
            if key[i * ps : (i + 1) * ps] != tokens[pos + i * ps : pos + (i + 1) * ps]:
                return i
        return n

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child`` after ``k`` pages; returns the new prefix node.

        The original object keeps the suffix, so a request holding it keeps
        unlocking the right path; the prefix inherits its stats and lock count.
        """
        ps = self.page_size
        parent = child.parent
        assert parent is not None
        prefix = TreeNode(next(self._ids), child.key[: k * ps], child.pages[:k], parent, 0)
        prefix.last_access_time = child.last_access_time
        prefix.creation_time = child.creation_time
        prefix.hit_count = child.hit_count
        prefix.priority = child.priority
        prefix.lock_ref = child.lock_ref
        if child.hashes:
            prefix.hashes, child.hashes = child.hashes[:k], child.hashes[k:]
        child.key = child.key[k * ps :]
        child.pages = child.pages[k:]
        child.parent = prefix
        prefix.children[child.key[:ps]] = child
        parent.children[prefix.key[:ps]] = prefix
        return prefix

    def _remove_leaf(self, node: TreeNode) -> list[int]:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.key[: self.page_size]]
        node.parent = None
        if parent.parent is None and parent is not self.root and not parent.children:
            self._roots = {ns: r for ns, r in self._roots.items() if r is not parent}
        self.num_cached_pages -= len(node.pages)
        self.num_evictable_pages -= len(node.pages)
        if self.events is not None and node.hashes:
            self.events.removed(node.hashes)
        return node.pages
