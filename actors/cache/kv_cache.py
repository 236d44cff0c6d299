"""KVCacheManager: the page allocator plus the radix prefix cache behind one facade.

With ``step.apply_step`` (the order of a step's operations, lpm, in-flight prefix
waits, the HiCache tier) this is the whole policy of the cache_manager actor; the
actor only hands each step to ``apply_step`` and sends the result back. Pure
Python: no asyncio, zmq or torch.

Page ownership, which ``check_invariants`` enforces: every page is exactly one of
*free* (in the allocator), *cached* (owned by the radix tree, possibly shared by
several requests) or *private* (owned by one running request). A request's page
table is its cached prefix pages followed by its private pages.

A request computed with a LoRA adapter names it (``namespace``, the adapter's id):
its prefix is matched and cached among that adapter's entries only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .allocator import PageAllocator
from .blocks import BlockEvents
from .eviction import EvictionStrategy, make_strategy
from .radix import InsertResult, RadixTree, TreeNode

__all__ = ["Admission", "FlushResult", "KVCacheManager"]


class Admission(NamedTuple):
    cached_len: int  # leading tokens whose KV is already in page_ids (a multiple of page_size)
    page_ids: list[int]  # the request's whole page table: cached prefix, then fresh pages


class FlushResult(NamedTuple):
    freed_pages: int
    pages_in_use: int  # cached pages still locked by running requests (0: fully flushed)


@dataclass
class _Request:
    pages: list[int]  # page table, in token order
    num_shared: int  # leading pages owned by the tree (locked via lock_node)
    lock_node: TreeNode | None
    priority: int
    computing: tuple[str, tuple[int, ...]] | None = None  # its key in KVCacheManager._computing
    namespace: str = ""  # the LoRA adapter its KV was computed with ("" = the base model)


class KVCacheManager:
    """Admission, growth and release of requests' KV pages, with prefix sharing.

    ``policy`` is a name in ``EVICTION_POLICIES`` or a strategy instance. With
    ``enable_prefix_cache=False`` nothing is shared or cached: pages are private
    from admission to release.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        enable_prefix_cache: bool = True,
        policy: str | EvictionStrategy = "lru",
        wait_min_tokens: int = 32,
        events: BlockEvents | None = None,
    ) -> None:
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.allocator = PageAllocator(num_pages)
        self.tree = RadixTree(page_size, make_strategy(policy), events)
        self._requests: dict[str, _Request] = {}
        # Prompts admitted but not yet in the tree (no cache_prefix yet), by their first
        # page of tokens: what ``waits_for`` compares a new prompt with.
        self.wait_min_tokens = max(wait_min_tokens, page_size)
        self._computing: dict[tuple[str, tuple[int, ...]], dict[str, np.ndarray]] = {}

    # ---- per-request operations --------------------------------------------

    def admit(
        self,
        rid: str,
        token_ids: Sequence[int],
        extra_pages: int = 0,
        *,
        priority: int = 0,
        namespace: str = "",
    ) -> Admission | None:
        """Reserve pages for all of ``token_ids`` plus ``extra_pages`` more (decode headroom).

        Reuses the longest cached prefix (locked until ``finish``/``release``),
        evicting unlocked cache entries if free pages run short. The prefix stops
        before the last token so at least one token is computed (the one whose
        logits are sampled). Returns None, changing nothing, if the pages cannot be
        found even after eviction.
        """
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already admitted")
        if not token_ids:
            raise ValueError("cannot admit an empty prompt")
        if extra_pages < 0:
            raise ValueError(f"extra_pages must be >= 0, got {extra_pages}")
        total_pages = -(-len(token_ids) // self.page_size) + extra_pages
        node: TreeNode | None = None
        shared: list[int] = []
        if self.enable_prefix_cache:
            match = self.tree.match_prefix(token_ids[:-1], touch=False, namespace=namespace)
            node, shared = match.node, match.pages
            self.tree.lock(node)  # before evicting, so the match cannot evict itself
        fresh = self._alloc(total_pages - len(shared))
        if fresh is None:
            if node is not None:
                self.tree.unlock(node)
            return None
        if node is not None:
            self.tree.touch(node)
            self.tree.record_lookup(len(token_ids), len(shared) * self.page_size)
        pages = shared + fresh
        self._requests[rid] = _Request(pages, len(shared), node, priority, namespace=namespace)
        if self.enable_prefix_cache and len(token_ids) > self.page_size:
            key = (namespace, tuple(token_ids[: self.page_size]))
            self._computing.setdefault(key, {})[rid] = np.asarray(token_ids, dtype=np.int64)
            self._requests[rid].computing = key
        return Admission(len(shared) * self.page_size, list(pages))

    def waits_for(self, token_ids: Sequence[int], namespace: str = "") -> str | None:
        """The running request still computing a prefix this prompt shares, if any.

        SGLang's in-batch prefix caching: when prompts sharing an uncached prefix
        (a system prompt, a few-shot block) arrive together, admitting them all
        computes that prefix once per prompt. A prompt that shares at least
        ``wait_min_tokens`` tokens of full pages beyond what the tree holds with a
        prompt admitted but not yet cached should wait: once that one's prefill is
        in the tree (``cache_prefix``), this one's admission matches it.
        """
        ps = self.page_size
        key = (namespace, tuple(token_ids[:ps]))
        group = self._computing.get(key) if self.enable_prefix_cache else None
        if not group:
            return None
        cached = self.tree.match_prefix(token_ids[:-1], touch=False, namespace=namespace).num_tokens
        ids = np.asarray(token_ids[:-1], dtype=np.int64)  # the last token is always computed
        for rid, other in group.items():
            n = min(len(ids), len(other))
            differ = np.flatnonzero(ids[:n] != other[:n])
            common = int(differ[0]) if differ.size else n
            if common // ps * ps - cached >= self.wait_min_tokens:
                return rid
        return None

    def extend(self, rid: str, num_pages: int, more_pages: int = 0) -> list[int] | None:
        """Append ``num_pages`` fresh pages to the request (evicting if needed), and
        ``more_pages`` more where the pool has room to spare (``_alloc``); None if even
        the first cannot be had."""
        req = self._requests[rid]
        if num_pages < 0 or more_pages < 0:
            raise ValueError(f"page counts must be >= 0, got {num_pages} and {more_pages}")
        fresh = self._alloc(num_pages, more_pages)
        if fresh is not None:
            req.pages.extend(fresh)
        return fresh

    def cache_prefix(self, rid: str, token_ids: Sequence[int]) -> list[int]:
        """Share a running request's computed full pages now (after a prefill chunk).

        ``token_ids`` are the tokens whose KV its pages hold. Pages the tree already
        had under other ids are swapped for the tree's (identical KV) and freed; the
        new prefix is locked for the request. Returns the updated page table, which
        the worker must use from now on.
        """
        req = self._requests[rid]
        if not self.enable_prefix_cache:
            return list(req.pages)
        self._computed(rid, req)
        result = self._insert(req, token_ids)
        if result is None:
            return list(req.pages)
        n_full = len(result.pages)
        self.tree.lock(result.node)
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        self.allocator.free(result.redundant)
        req.pages[:n_full] = result.pages
        req.num_shared, req.lock_node = n_full, result.node
        return list(req.pages)

    def finish(self, rid: str, token_ids: Sequence[int], cache: bool = True) -> None:
        """End a request: cache its full pages (if ``cache``), unlock, free the rest.

        ``token_ids`` are the tokens whose KV its pages hold, in order (usually the
        prompt plus every output token but the last, which was never fed back).
        """
        req = self._requests[rid]
        self._computed(rid, req)
        adopted: set[int] = set()
        result = self._insert(req, token_ids) if cache and self.enable_prefix_cache else None
        if result is not None:
            redundant = set(result.redundant)
            adopted = {p for p in req.pages[req.num_shared : len(result.pages)]} - redundant
        del self._requests[rid]
        self._drop(req, adopted)

    def release(self, rid: str) -> bool:
        """Abort: unlock the prefix and free the private pages, caching nothing.

        Safe to call for an unknown or already finished request (returns False),
        since an abort can race with the request finishing.
        """
        req = self._requests.pop(rid, None)
        if req is None:
            return False
        self._computed(rid, req)
        self._drop(req, set())
        return True

    # ---- whole-cache operations -------------------------------------------

    def flush(self) -> FlushResult:
        """Drop every cached page no running request uses."""
        freed = self.tree.flush()
        self.allocator.free(freed)
        return FlushResult(len(freed), self.tree.num_cached_pages)

    def page_table(self, rid: str) -> list[int]:
        return list(self._requests[rid].pages)

    def namespace_of(self, rid: str) -> str:
        return self._requests[rid].namespace

    def __contains__(self, rid: object) -> bool:
        return rid in self._requests

    @property
    def num_private_pages(self) -> int:
        return sum(len(r.pages) - r.num_shared for r in self._requests.values())

    @property
    def num_available_pages(self) -> int:
        """Pages an admission could get right now: free plus evictable."""
        return self.allocator.num_free + self.tree.num_evictable_pages

    def stats(self) -> dict[str, float]:
        s: dict[str, float] = {
            "pages_total": self.allocator.num_pages,
            "pages_free": self.allocator.num_free,
            "pages_used": self.allocator.num_used,
            "pages_private": self.num_private_pages,
            "running_requests": len(self._requests),
        }
        s.update(self.tree.stats())
        return s

    def check_invariants(self) -> None:
        """Raise AssertionError unless free + private + cached == total with no overlap."""
        self.tree.check()
        free = set(self.allocator.free_page_ids())
        cached = set(self.tree.cached_pages())
        private: set[int] = set()
        locks = 0
        for rid, req in self._requests.items():
            mine = req.pages[req.num_shared :]
            assert not private.intersection(mine), f"{rid}: private page shared"
            private.update(mine)
            assert cached.issuperset(req.pages[: req.num_shared]), f"{rid}: prefix not cached"
            locks += req.lock_node is not None and req.lock_node.parent is not None
        assert len(free) == self.allocator.num_free, "duplicate in free list"
        assert not free & cached and not free & private and not cached & private
        total = len(free) + len(private) + len(cached)
        assert total == self.allocator.num_pages, (len(free), len(private), len(cached))
        for key, group in self._computing.items():
            assert group and all(self._requests[r].computing == key for r in group), key
        top = sum(c.lock_ref for root in self.tree.roots for c in root.children.values())
        assert top == locks, f"{top} references on the tree, {locks} held by requests"

    # ---- internals ------------------------------------------------------------

    def _alloc(self, n: int, more: int = 0) -> list[int] | None:
        """``n`` fresh pages, evicting unlocked cache entries first if needed; and ``more``
        with them (one run of ids, as the free list hands them out) while a quarter of
        the pool stays available after: where it is tighter, pages go to admitting more
        requests instead. The scheduler asks for ``more`` where a decode's pages should
        lie together (``--decode-page-run``: on a CPU, its K and V in runs the hardware
        prefetcher follows; the CPU platform's ``default_decode_page_run`` has numbers).
        """
        if more and self.num_available_pages - n - more >= self.allocator.num_pages // 4:
            n += more
        short = n - self.allocator.num_free
        if short > 0:
            if short > self.tree.num_evictable_pages:
                return None  # fail before evicting: a refused admission changes nothing
            self.allocator.free(self.tree.evict(short))
        return self.allocator.alloc(n)

    def _computed(self, rid: str, req: _Request) -> None:
        """The request's prompt is in the tree, or never will be: nobody waits for it."""
        if req.computing is None:
            return
        group = self._computing[req.computing]
        del group[rid]
        if not group:
            del self._computing[req.computing]
        req.computing = None

    def _insert(self, req: _Request, token_ids: Sequence[int]) -> InsertResult | None:
        """Insert the request's full pages beyond its cached prefix; None if there are none."""
        ps = self.page_size
        n_full = min(len(token_ids) // ps, len(req.pages))
        if n_full <= req.num_shared:
            return None
        # Tokens that disagree with the admitted prefix would file the request's shared
        # pages under a second key; refuse before the tree is touched.
        ns = req.namespace
        shared = self.tree.match_prefix(
            token_ids[: req.num_shared * ps], touch=False, namespace=ns
        ).pages
        if shared != req.pages[: req.num_shared]:
            raise ValueError(
                "token_ids do not start with the prefix this request was admitted with"
            )
        return self.tree.insert(
            token_ids[: n_full * ps], req.pages[:n_full], priority=req.priority, namespace=ns
        )

    def _drop(self, req: _Request, adopted: set[int]) -> None:
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        self.allocator.free(p for p in req.pages[req.num_shared :] if p not in adopted)
