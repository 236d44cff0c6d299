"""scheduler ⇄ cache_manager: at most one CacheStep exchange per forward step.

The cache manager applies a step's operations in a fixed order: finishes,
releases, commits, extends, then admits (so pages freed by the first ones serve
the last ones).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from .base import Message
from .step import PageIO

__all__ = [
    "AdmitOp",
    "Admitted",
    "CacheEvents",
    "CacheStep",
    "CacheStepResult",
    "CommitOp",
    "ExtendOp",
    "FinishOp",
]


class FinishOp(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    token_ids: list[int]  # the tokens whose KV the request's pages hold
    cache: bool = True  # insert its full pages into the prefix tree


class CommitOp(msgspec.Struct, frozen=True, array_like=True):
    """Share a running request's computed full pages now (after its prefill)."""

    rid: str
    token_ids: list[int]


class ExtendOp(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    num_pages: int
    # up to this many pages more, in the same run of ids, where the pool has room to
    # spare (KVCacheManager.extend): a decode's next pages beside each other
    more_pages: int = 0


class AdmitOp(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    token_ids: list[int]
    extra_pages: int = 0
    priority: int = 0
    lora_id: str = ""  # the adapter whose KV this is: prefixes are shared within one only
    more_pages: int = 0  # as ExtendOp's: decode pages right after the prompt's, if room


class CacheStep(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "cache.step"
    finishes: list[FinishOp] = []
    releases: list[str] = []
    commits: list[CommitOp] = []
    extends: list[ExtendOp] = []
    admits: list[AdmitOp] = []  # tried in order; stops at the first that does not fit
    longest_prefix_first: bool = False  # reorder admits by cached prefix length (lpm)
    # Which life of the KV pool these pages belong to: when it changes (the worker or
    # the cache manager was lost, or the scheduler restarted) every mapping is dropped
    # before anything else in the step.
    pool_epoch: int = 0
    forget_keys: list[str] = []  # HiCache keys storage lost: no longer known to be stored


class Admitted(msgspec.Struct, frozen=True, array_like=True):
    rid: str
    cached_len: int
    page_ids: list[int]


class CacheStepResult(Message, frozen=True, kw_only=True):
    TAG: ClassVar[str] = "cache.step_result"
    admitted: list[Admitted] = []  # in admission order; the rest stay waiting
    extended: dict[str, list[int]] = {}  # rid → new pages; a missing rid was refused
    committed: dict[str, list[int]] = {}  # rid → its page table after sharing
    # HiCache storage tier: pages the worker saves, and pages it loads for the admitted.
    store_pages: list[PageIO] = []
    load_pages: list[PageIO] = []


class CacheEvents(Message, frozen=True, kw_only=True):
    """cache_manager → tokenizer (its router), with data-parallel replicas only: the
    blocks that entered and left this replica's prefix tree since the last one, sent
    after the step (or flush) that changed it. A block is one full page, named by its
    chained hash (``actors.cache.blocks``: blake2b-64 over the hash of the page before
    it, then the page's token ids as little-endian int64; the first page's parent is 0),
    so one hash names a whole prefix. ``reset``: every block was dropped first."""

    TAG: ClassVar[str] = "cache.events"
    stored: list[int] = []
    removed: list[int] = []
    reset: bool = False
