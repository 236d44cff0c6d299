"""Router policies (``--router-policy``): which data-parallel replica takes a request.

A policy sees, for each replica that is up, its load (requests routed to it and not
finished) and how many of the prompt's leading tokens its prefix cache holds, and
picks one. ``cache_aware`` follows SGLang's router: the replica with the longest cached
prefix when that covers ``--router-cache-threshold`` of the prompt, unless the loads
are unbalanced (they differ by more than ``--router-balance-abs`` and the busiest has
more than ``--router-balance-rel`` times the idlest's), when the least loaded takes it;
with no good match, the least loaded too.

Plugins add one with::

    from actorlm.extensions.points import ROUTER_POLICIES
    ROUTER_POLICIES.register("my-policy", MyPolicy)  # a RouterPolicy class

Pure Python: no asyncio, zmq or torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from ...config import RouterConfig
from ...extensions.points import ROUTER_POLICIES

__all__ = [
    "CacheAwarePolicy",
    "LeastLoadPolicy",
    "ReplicaView",
    "RoundRobinPolicy",
    "RouteRequest",
    "RouterPolicy",
    "make_policy",
]


@dataclass(frozen=True)
class ReplicaView:
    """One replica as a policy sees it, for one request."""

    index: int
    load: int  # requests routed to it and not finished
    matched_tokens: int  # leading prompt tokens its prefix cache holds (whole pages)
    cached_blocks: int  # pages its prefix cache holds in all


@dataclass(frozen=True)
class RouteRequest:
    rid: str
    num_tokens: int  # the prompt's length


class RouterPolicy(ABC):
    """Picks the replica of each request. Built with the ``[router]`` settings."""

    name: str = ""
    # Whether the router must compute each replica's cached prefix for this policy
    # (hashing the prompt's pages); policies that never read matched_tokens skip it.
    uses_cache: bool = False

    def __init__(self, settings: RouterConfig) -> None:
        self.settings = settings

    @abstractmethod
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        """The ``index`` of one of ``replicas`` (never empty: only those up)."""


def least_loaded(replicas: Sequence[ReplicaView]) -> ReplicaView:
    """The least loaded; ties go to the smallest cache (room to cache more), then index."""
    return min(replicas, key=lambda r: (r.load, r.cached_blocks, r.index))


class CacheAwarePolicy(RouterPolicy):
    """Longest cached prefix above the threshold, unless the loads are unbalanced."""

    name = "cache_aware"
    uses_cache = True

    def __init__(self, settings: RouterConfig) -> None:
        super().__init__(settings)
        self.decisions = {"cache": 0, "balance": 0, "load": 0}

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        s = self.settings
        loads = [r.load for r in replicas]
        high, low = max(loads), min(loads)
        if high - low > s.router_balance_abs and high > s.router_balance_rel * low:
            self.decisions["balance"] += 1
            return least_loaded(replicas).index
        best = max(replicas, key=lambda r: (r.matched_tokens, -r.load, -r.index))
        if request.num_tokens and best.matched_tokens / request.num_tokens >= (
            s.router_cache_threshold
        ):
            self.decisions["cache"] += 1
            return best.index
        self.decisions["load"] += 1
        return least_loaded(replicas).index


class RoundRobinPolicy(RouterPolicy):
    """Each replica in turn, whatever it holds."""

    name = "round_robin"

    def __init__(self, settings: RouterConfig) -> None:
        super().__init__(settings)
        self.turn = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        pick = replicas[self.turn % len(replicas)]
        self.turn += 1
        return pick.index


class LeastLoadPolicy(RouterPolicy):
    """The replica with the fewest requests in flight."""

    name = "least_load"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return least_loaded(replicas).index


for _cls in (CacheAwarePolicy, RoundRobinPolicy, LeastLoadPolicy):
    ROUTER_POLICIES.register_builtin(_cls.name, _cls, help=(_cls.__doc__ or "").split("\n")[0])


def make_policy(settings: RouterConfig) -> RouterPolicy:
    """The policy ``settings.router_policy`` names ("" = cache_aware)."""
    name = settings.router_policy or CacheAwarePolicy.name
    policy = ROUTER_POLICIES.get(name)(settings)
    if not isinstance(policy, RouterPolicy):
        raise TypeError(f"router policy {name!r} built {policy!r}, not a RouterPolicy")
    return policy
