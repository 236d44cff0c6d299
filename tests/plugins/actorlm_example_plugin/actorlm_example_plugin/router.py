"""A router policy: ``router_policy="example_last_replica"`` (with ``dp_size`` > 1)."""

from __future__ import annotations

from collections.abc import Sequence

from actorlm.actors.router.policies import ReplicaView, RouteRequest, RouterPolicy

from .record import record

__all__ = ["LastReplica"]


class LastReplica(RouterPolicy):
    """Every request to the replica with the highest index that is up."""

    name = "example_last_replica"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        record("router.choose")
        return max(r.index for r in replicas)
