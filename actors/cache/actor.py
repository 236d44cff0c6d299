"""CacheManagerActor: a thin shell over :class:`KVCacheManager` (page ids only).

It owns the page allocator, the radix prefix tree, reference counts and the
eviction policy. The KV tensors themselves live in the worker. One
``CacheStep`` request per scheduler step carries every operation.

With a HiCache storage backend (``--hicache-storage-backend file
--hicache-storage-dir DIR``) every full page that enters the prefix tree is
also saved to storage under a key naming its whole prefix, and an admission
whose prefix goes on past the tree loads the following pages from storage
instead of computing them, so a prefix outlives the server that computed it.
The page moves ride on the step's messages (scheduler → worker), so the worker
saves a page before anything can overwrite it.

Each ``CacheStep`` names the pool epoch its pages belong to; the scheduler bumps it
when the KV pool's contents are lost (a worker or cache manager died or restarted).
A new epoch drops every page mapping first, so no admission is ever served from KV
that died with a worker.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from ...extensions.points import HICACHE_STORAGE
from ...messages.cache import Admitted, CacheStep, CacheStepResult
from ...messages.control import Ack, FlushCache
from ...messages.envelope import Envelope
from ...messages.step import PageIO
from ..runtime import Actor, handles
from .hicache import HiCacheStorage, page_keys, storage_model_id
from .kv_cache import Admission, KVCacheManager

__all__ = ["CacheManagerActor"]

log = logging.getLogger(__name__)


class CacheManagerActor(Actor):
    role = "cache_manager"

    async def on_start(self) -> None:
        self.kv = self._new_cache()
        self.storage: HiCacheStorage | None = open_storage(self.config)
        self.model_id = storage_model_id(self.config)
        self._stored: set[str] = set()  # keys known to be in storage
        self.storage_hits = 0
        self.prefix_waits = 0  # admissions put off to share a prefix being computed
        self.pool_epoch = 0
        self.resets = 0

    def _new_cache(self) -> KVCacheManager:
        model, cache = self.config.model, self.config.cache
        if model.num_pages <= 0:
            raise ValueError("the cache manager needs model.num_pages (resolve the config first)")
        return KVCacheManager(
            model.num_pages,
            model.page_size,
            enable_prefix_cache=cache.enable_prefix_cache,
            policy=cache.eviction_policy,
        )

    def ready_info(self) -> dict[str, Any]:
        return {
            "pages_total": self.kv.allocator.num_pages,
            "eviction_policy": self.config.cache.eviction_policy,
        }

    def stats(self) -> dict[str, Any]:
        return {
            **self.kv.stats(),
            "storage_hit_pages": self.storage_hits,
            "prefix_waits": self.prefix_waits,
            "pool_resets": self.resets,
            "storage_corrupt": getattr(self.storage, "corrupt", 0),
            "consistent": self._consistent(),
        }

    def _consistent(self) -> bool:
        """The cache core's own check: every page free, private or cached, exactly once."""
        try:
            self.kv.check_invariants()
        except AssertionError as exc:
            log.error("the KV cache is inconsistent: %s", exc)
            return False
        return True

    @handles(FlushCache)
    async def on_flush(self, msg: FlushCache, env: Envelope) -> Ack:
        result = self.kv.flush()
        if result.pages_in_use:
            return Ack(
                ok=False,
                detail=f"{result.pages_in_use} cached pages are in use by running requests",
            )
        return Ack(ok=True, detail=f"freed {result.freed_pages} pages")

    @handles(CacheStep)
    async def on_step(self, msg: CacheStep, env: Envelope) -> CacheStepResult:
        if msg.pool_epoch != self.pool_epoch:
            if self.pool_epoch:
                # The KV tensors these pages named are gone: every mapping is garbage now.
                log.warning("a new KV pool epoch: dropping every page mapping")
                self.resets += 1
            self.kv = self._new_cache()
            self.pool_epoch = msg.pool_epoch
        kv = self.kv
        self._stored.difference_update(msg.forget_keys)
        stores: list[PageIO] = []
        for fin in msg.finishes:
            if fin.rid in kv:
                if fin.cache and self.storage is not None:
                    ns = kv.namespace_of(fin.rid)
                    stores += self._to_store(fin.token_ids, kv.page_table(fin.rid), ns)
                kv.finish(fin.rid, fin.token_ids, fin.cache)
        for rid in msg.releases:
            kv.release(rid)
        committed = {}
        for commit in msg.commits:
            if commit.rid in kv:
                committed[commit.rid] = table = kv.cache_prefix(commit.rid, commit.token_ids)
                if self.storage is not None:
                    ns = kv.namespace_of(commit.rid)
                    stores += self._to_store(commit.token_ids, table, ns)
        extended: dict[str, list[int]] = {}
        for ext in msg.extends:
            if ext.rid in kv:
                pages = kv.extend(ext.rid, ext.num_pages)
                if pages is not None:
                    extended[ext.rid] = pages
        admits = list(msg.admits)
        if msg.longest_prefix_first and len(admits) > 1:
            lengths = {
                a.rid: kv.tree.match_prefix(
                    a.token_ids, touch=False, namespace=a.lora_id
                ).num_tokens
                for a in admits
            }
            admits.sort(key=lambda a: -lengths[a.rid])  # stable: ties keep queue order
        admitted: list[Admitted] = []
        loads: list[PageIO] = []
        for op in admits:
            if kv.waits_for(op.token_ids, op.lora_id) is not None:
                # a running request is computing the prefix this prompt shares: admit it
                # once that prefix is cached instead of computing it twice
                self.prefix_waits += 1
                continue
            got = kv.admit(
                op.rid, op.token_ids, op.extra_pages, priority=op.priority, namespace=op.lora_id
            )
            if got is None:
                break
            if self.storage is not None:
                got = self._load_from_storage(op.token_ids, got, loads, op.lora_id)
            admitted.append(Admitted(op.rid, got.cached_len, got.page_ids))
        return CacheStepResult(
            admitted=admitted,
            extended=extended,
            committed=committed,
            store_pages=stores,
            load_pages=loads,
        )

    def _model_id(self, namespace: str) -> str:
        """Storage keys cover what the KV bytes depend on: the adapter too."""
        return f"{self.model_id}\0lora:{namespace}" if namespace else self.model_id

    def _to_store(self, token_ids: list[int], table: list[int], namespace: str) -> list[PageIO]:
        keys = page_keys(self._model_id(namespace), token_ids, self.kv.page_size)
        out = [PageIO(k, p) for k, p in zip(keys, table, strict=False) if k not in self._stored]
        self._stored.update(io.key for io in out)
        return out

    def _load_from_storage(
        self, token_ids: list[int], got: Admission, loads: list[PageIO], namespace: str
    ) -> Admission:
        """Extend a tree hit with the pages storage holds next (never the last token)."""
        assert self.storage is not None
        ps = self.kv.page_size
        keys = page_keys(self._model_id(namespace), token_ids[:-1], ps)
        start = got.cached_len // ps
        wanted = keys[start:]
        known = 0
        while known < len(wanted) and wanted[known] in self._stored:
            known += 1
        found = known + (self.storage.batch_exists(wanted[known:]) if known < len(wanted) else 0)
        if not found:
            return got
        for i in range(start, start + found):
            loads.append(PageIO(keys[i], got.page_ids[i]))
            self._stored.add(keys[i])
        self.storage_hits += found
        return Admission(got.cached_len + found * ps, got.page_ids)


def open_storage(config: Any) -> HiCacheStorage | None:
    """The configured HiCache storage backend, constructed with the storage dir, or None."""
    name = config.cache.hicache_storage_backend
    if not name:
        return None
    if not config.cache.hicache_storage_dir:
        raise ValueError("--hicache-storage-backend needs --hicache-storage-dir")
    import actorlm.actors.cache.hicache  # noqa: F401  (registers the built-in backends)

    factory: Any = HICACHE_STORAGE.get(name)  # a storage class takes its directory
    return cast(HiCacheStorage, factory(config.cache.hicache_storage_dir))
