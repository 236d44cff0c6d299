"""CacheManagerActor: a thin shell over :class:`KVCacheManager` (page ids only).

It owns the page allocator, the radix prefix tree, reference counts and the
eviction policy. The KV tensors themselves live in the worker. One
``CacheStep`` request per scheduler step carries every operation.
"""

from __future__ import annotations

import logging
from typing import Any

from ..messages.cache import Admitted, CacheStep, CacheStepResult
from ..messages.control import Ack, FlushCache
from ..messages.envelope import Envelope
from .kv_cache import KVCacheManager
from .runtime import Actor, handles

__all__ = ["CacheManagerActor"]

log = logging.getLogger(__name__)


class CacheManagerActor(Actor):
    role = "cache_manager"
    inbox = (CacheStep, FlushCache)

    async def on_start(self) -> None:
        self.kv = self._new_cache()

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
        return dict(self.kv.stats())

    async def on_peer_down(self, role: str, reason: str) -> None:
        if role == "worker":
            # The KV tensors died with the worker: every cached page is garbage now.
            log.warning("worker died: dropping the whole prefix cache")
            self.kv = self._new_cache()

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
        kv = self.kv
        for op in msg.finishes:
            if op.rid in kv:
                kv.finish(op.rid, op.token_ids, op.cache)
        for rid in msg.releases:
            kv.release(rid)
        committed = {
            op.rid: kv.cache_prefix(op.rid, op.token_ids) for op in msg.commits if op.rid in kv
        }
        extended: dict[str, list[int]] = {}
        for ext in msg.extends:
            if ext.rid in kv:
                pages = kv.extend(ext.rid, ext.num_pages)
                if pages is not None:
                    extended[ext.rid] = pages
        admits = list(msg.admits)
        if msg.longest_prefix_first and len(admits) > 1:
            lengths = {
                a.rid: kv.tree.match_prefix(a.token_ids, touch=False).num_tokens for a in admits
            }
            admits.sort(key=lambda a: -lengths[a.rid])  # stable: ties keep queue order
        admitted: list[Admitted] = []
        for op in admits:
            got = kv.admit(op.rid, op.token_ids, op.extra_pages, priority=op.priority)
            if got is None:
                break
            admitted.append(Admitted(op.rid, got.cached_len, got.page_ids))
        return CacheStepResult(
            admitted=admitted,
            extended=extended,
            committed=committed,
            pages_free=kv.allocator.num_free,
            pages_total=kv.allocator.num_pages,
        )
