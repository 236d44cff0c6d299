"""The router's state: each data-parallel replica's load and cached blocks.

The tokenizer owns one :class:`Router` when ``--dp-size`` > 1. It asks it where each
tokenized request goes (``route``: that replica's scheduler), tells it when one
finishes, and hands it each replica cache manager's ``CacheEvents``: the exact blocks
(chained page hashes, ``actors.cache.blocks``) that entered and left that replica's
prefix tree, so the prefix a replica holds for a prompt is known, not guessed from past
routing. A replica any of whose members is down takes nothing; a lost cache manager
empties its replica's view. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...config import EngineConfig
from ...messages.cache import CacheEvents
from ..cache.blocks import block_hashes
from ..replicas import base_role, replica_index, replica_role
from .policies import ReplicaView, RouteRequest, RouterPolicy, make_policy

__all__ = ["Replica", "Router"]


@dataclass
class Replica:
    index: int
    blocks: set[int] = field(default_factory=set)  # its prefix tree's pages, by chained hash
    down: set[str] = field(default_factory=set)  # its members that are down now
    draining: bool = False  # taken out of routing (POST /drain_replica)
    load: int = 0  # routed, not finished
    routed: int = 0  # in all

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading pages of ``hashes`` this replica's cache holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n


class Router:
    def __init__(self, config: EngineConfig, policy: RouterPolicy | None = None) -> None:
        self.page_size = config.model.page_size
        self.policy = policy or make_policy(config.router)
        self.replicas = [Replica(i) for i in range(config.router.dp_size)]
        self.owner: dict[str, int] = {}  # rid → its replica, until it finishes

    def route(self, rid: str, token_ids: Sequence[int]) -> str | None:
        """The scheduler role that takes ``rid``, or None when no replica is up."""
        up = [r for r in self.replicas if not (r.down or r.draining)]
        if not up:
            return None
        hashes: list[int] = []
        if self.policy.uses_cache:  # the cache can serve all but the last token (admission)
            hashes = block_hashes(token_ids[:-1], self.page_size)
        views = [
            ReplicaView(r.index, r.load, r.matched(hashes) * self.page_size, len(r.blocks))
            for r in up
        ]
        index = self.policy.choose(RouteRequest(rid, len(token_ids)), views)
        if index not in {v.index for v in views}:
            raise ValueError(f"router policy {self.policy.name!r} chose replica {index}, not up")
        replica = self.replicas[index]
        replica.load += 1
        replica.routed += 1
        self.owner[rid] = index
        return replica_role("scheduler", index)

    def scheduler_of(self, rid: str) -> str:
        return replica_role("scheduler", self.owner.get(rid, 0))

    def finish(self, rid: str) -> None:
        index = self.owner.pop(rid, None)
        if index is not None:
            self.replicas[index].load -= 1

    def on_events(self, sender: str, msg: CacheEvents) -> None:
        if base_role(sender) != "cache_manager" or replica_index(sender) >= len(self.replicas):
            return
        blocks = self.replicas[replica_index(sender)].blocks
        if msg.reset:
            blocks.clear()
        blocks.difference_update(msg.removed)
        blocks.update(msg.stored)

    def member_down(self, role: str) -> list[str]:
        """``role`` went down: its replica takes nothing until it is back. Returns the
        requests that ended with it (a scheduler holds its replica's requests)."""
        base, index = base_role(role), replica_index(role)
        if base not in ("scheduler", "cache_manager", "worker") or index >= len(self.replicas):
            return []
        replica = self.replicas[index]
        replica.down.add(role)
        if base == "cache_manager":
            replica.blocks.clear()  # its successor starts empty
        if base != "scheduler":
            return []  # the scheduler fails (or recomputes) what ran there itself
        lost = [rid for rid, i in self.owner.items() if i == index]
        for rid in lost:
            self.finish(rid)
        return lost

    def drain(self, index: int, drain: bool = True) -> int:
        """Route nothing new to replica ``index`` while ``drain`` (or again, once False);
        its load: requests routed there and not finished. ValueError for a bad index, or
        for draining the last replica that takes requests."""
        if not 0 <= index < len(self.replicas):
            raise ValueError(f"no replica {index}: there are {len(self.replicas)} (0 to n-1)")
        replica = self.replicas[index]
        others = [r for r in self.replicas if r is not replica and not r.draining]
        if drain and not replica.draining and not others:
            raise ValueError(
                f"replica {index} is the last one taking requests: drain it with /drain"
            )
        replica.draining = drain
        return replica.load

    def member_up(self, role: str) -> None:
        index = replica_index(role)
        if index < len(self.replicas):
            self.replicas[index].down.discard(role)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "router_policy": self.policy.name,
            "router_routed": [r.routed for r in self.replicas],
            "router_load": [r.load for r in self.replicas],
            "router_cached_blocks": [len(r.blocks) for r in self.replicas],
            "router_draining": [r.index for r in self.replicas if r.draining],
        }
        decisions = getattr(self.policy, "decisions", None)
        if isinstance(decisions, dict):
            out["router_decisions"] = dict(decisions)
        return out
