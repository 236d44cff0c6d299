"""CacheManagerActor: a thin shell over :class:`KVCacheManager` (page ids only).

It owns the page allocator, the radix prefix tree, reference counts and the
eviction policy. The KV tensors themselves live in the worker. One
``CacheStep`` request per scheduler step carries every operation; the pure
``step.apply_step`` decides what each does, and this shell replies with it.

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

With data-parallel replicas (``--dp-size`` > 1) it also tells the tokenizer's router,
after each step or flush that changed its prefix tree, which blocks entered and left it
(one ``CacheEvents``, netted), so the router routes by what each cache really holds.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from ...extensions.points import HICACHE_STORAGE
from ...messages.cache import CacheEvents, CacheStep, CacheStepResult
from ...messages.control import Ack, FlushCache
from ...messages.envelope import Envelope
from ..replicas import replica_index
from ..runtime import Actor, ActorError, handles
from .blocks import BlockEvents
from .hicache import HiCacheStorage, storage_model_id
from .kv_cache import KVCacheManager
from .step import HiCacheTier, apply_step

__all__ = ["CacheManagerActor"]

log = logging.getLogger(__name__)


class CacheManagerActor(Actor):
    role = "cache_manager"

    async def on_start(self) -> None:
        # Only a router reads them, and it routes to the data-parallel replicas alone.
        routed = (
            self.config.router.dp_size > 1 and replica_index(self.role) < self.config.router.dp_size
        )
        self.events = BlockEvents() if routed else None
        self.kv = self._new_cache()
        self.storage: HiCacheStorage | None = open_storage(self.config)
        self.tier: HiCacheTier | None = None
        if self.storage is not None:
            self.tier = HiCacheTier(self.storage, storage_model_id(self.config))
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
            events=self.events,
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
        await self._send_events()
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
            if self.events is not None:
                self.events.clear_all()
            self.kv = self._new_cache()
            self.pool_epoch = msg.pool_epoch
        outcome = apply_step(self.kv, msg, self.tier)
        self.prefix_waits += outcome.prefix_waits
        self.storage_hits += outcome.storage_hit_pages
        await self._send_events()  # before the reply: the router knows before any client
        return outcome.result

    async def on_peer_up(self, role: str) -> None:
        if role == "tokenizer" and getattr(self, "events", None) is not None:
            # A tokenizer heard from anew (a restart, or the first time): its router
            # starts from nothing, so it gets this whole cache first.
            assert self.events is not None
            self.events.clear_all()
            self.events.stored(self.kv.tree.cached_blocks())
            await self._send_events()

    async def _send_events(self) -> None:
        if not self.events:
            return
        reset, stored, removed = self.events.take()
        try:
            await self.send("tokenizer", CacheEvents(stored=stored, removed=removed, reset=reset))
        except ActorError as exc:  # its successor starts from empty views: nothing is lost
            log.warning("cannot tell the router about this cache: %s", exc)


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
