"""One ``CacheStep`` applied to the KV cache core: every decision the cache manager makes.

Pure Python (no asyncio, zmq or torch), so the scheduler's policy tests drive the
very step the actor runs. The actor keeps only the plumbing: which pool epoch's
core is live, the storage backend it opened, its counters and the reply.

The operations run in the order ``messages/cache.py`` documents: finishes,
releases, commits, extends, then admits, so pages freed by the first serve the
last. Admits are tried in order, longest cached prefix first when the step asks
(``lpm``), and stop at the first that does not fit. A prompt sharing a prefix that
a running request is still computing is passed over for this step: once that
prefix is in the tree, its admission matches it instead of computing it again.

With a HiCache tier every full page that enters the prefix tree is also named for
storage (``store_pages``), and an admission whose prefix goes on past the tree
takes the pages storage holds next (``load_pages``) instead of computing them. The
worker moves those pages, in that order, before the forward step that needs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ...messages.cache import AdmitOp, Admitted, CacheStep, CacheStepResult
from ...messages.step import PageIO
from .hicache import HiCacheStorage, page_keys
from .kv_cache import Admission, KVCacheManager

__all__ = ["HiCacheTier", "StepOutcome", "apply_step"]


class StepOutcome(NamedTuple):
    result: CacheStepResult  # the reply to the scheduler
    prefix_waits: int  # admissions put off to share a prefix being computed
    storage_hit_pages: int  # pages admissions take from storage instead of computing


class HiCacheTier:
    """A storage backend as the cache manager sees it: the keys known to be stored.

    Keys saved (or found) once are not asked about again, so an admission costs a
    ``batch_exists`` call only for pages this server has never seen.
    """

    def __init__(self, storage: HiCacheStorage, model_id: str) -> None:
        self.storage = storage
        self.model_id = model_id
        self.known: set[str] = set()

    def key_model(self, namespace: str) -> str:
        """Storage keys cover what the KV bytes depend on: the adapter too."""
        return f"{self.model_id}\0lora:{namespace}" if namespace else self.model_id

    def forget(self, keys: Iterable[str]) -> None:
        self.known.difference_update(keys)

    def to_store(
        self, token_ids: Sequence[int], table: list[int], page_size: int, namespace: str
    ) -> list[PageIO]:
        """The full pages of ``table`` that storage does not hold yet."""
        keys = page_keys(self.key_model(namespace), token_ids, page_size)
        out = [PageIO(k, p) for k, p in zip(keys, table, strict=False) if k not in self.known]
        self.known.update(io.key for io in out)
        return out

    def extend(
        self, token_ids: Sequence[int], got: Admission, page_size: int, namespace: str
    ) -> tuple[Admission, list[PageIO]]:
        """A tree hit extended with the pages storage holds next (never the last token)."""
        keys = page_keys(self.key_model(namespace), token_ids[:-1], page_size)
        start = got.cached_len // page_size
        wanted = keys[start:]
        known = 0
        while known < len(wanted) and wanted[known] in self.known:
            known += 1
        found = known + (self.storage.batch_exists(wanted[known:]) if known < len(wanted) else 0)
        loads = [PageIO(keys[i], got.page_ids[i]) for i in range(start, start + found)]
        self.known.update(io.key for io in loads)
        return Admission(got.cached_len + found * page_size, got.page_ids), loads


def apply_step(kv: KVCacheManager, step: CacheStep, tier: HiCacheTier | None = None) -> StepOutcome:
    """Apply every operation of ``step`` to ``kv`` (and ``tier``): what to reply, and counts."""
    ps = kv.page_size
    stores: list[PageIO] = []
    if tier is not None:
        tier.forget(step.forget_keys)
    for fin in step.finishes:
        if fin.rid in kv:
            if fin.cache and tier is not None:
                table = kv.page_table(fin.rid)
                stores += tier.to_store(fin.token_ids, table, ps, kv.namespace_of(fin.rid))
            kv.finish(fin.rid, fin.token_ids, fin.cache)
    for rid in step.releases:
        kv.release(rid)
    committed: dict[str, list[int]] = {}
    for commit in step.commits:
        if commit.rid in kv:
            committed[commit.rid] = table = kv.cache_prefix(commit.rid, commit.token_ids)
            if tier is not None:
                stores += tier.to_store(commit.token_ids, table, ps, kv.namespace_of(commit.rid))
    extended: dict[str, list[int]] = {}
    for ext in step.extends:
        if ext.rid in kv:
            pages = kv.extend(ext.rid, ext.num_pages, ext.more_pages)
            if pages is not None:
                extended[ext.rid] = pages
    admits = _admission_order(kv, step)
    admitted: list[Admitted] = []
    loads: list[PageIO] = []
    waits = 0
    for op in admits:
        if kv.waits_for(op.token_ids, op.lora_id) is not None:
            # admitted now, it would compute a prefix a running request is computing
            waits += 1
            continue
        got = kv.admit(
            op.rid, op.token_ids, op.extra_pages, priority=op.priority, namespace=op.lora_id
        )
        if got is None:
            break  # no smaller one after it jumps the queue into the pages it needs
        if op.more_pages:  # the free list's next ids: one run with the prompt's new pages
            more = kv.extend(op.rid, 0, op.more_pages) or []
            got = Admission(got.cached_len, got.page_ids + more)
        if tier is not None:
            got, found = tier.extend(op.token_ids, got, ps, op.lora_id)
            loads += found
        admitted.append(Admitted(op.rid, got.cached_len, got.page_ids))
    result = CacheStepResult(
        admitted=admitted,
        extended=extended,
        committed=committed,
        store_pages=stores,
        load_pages=loads,
    )
    return StepOutcome(result, waits, len(loads))


def _admission_order(kv: KVCacheManager, step: CacheStep) -> list[AdmitOp]:
    """The step's admits in queue order, or by longest cached prefix (``lpm``)."""
    admits = list(step.admits)
    if step.longest_prefix_first and len(admits) > 1:
        lengths = {
            a.rid: kv.tree.match_prefix(a.token_ids, touch=False, namespace=a.lora_id).num_tokens
            for a in admits
        }
        admits.sort(key=lambda a: -lengths[a.rid])  # stable: ties keep queue order
    return admits
