"""Data-parallel replicas' role names (``--dp-size N``).

Each replica is a scheduler, a cache manager and a worker of its own. Replica 0 keeps
the plain names (``scheduler``, ``cache_manager``, ``worker``), so one replica is
exactly the single pipeline; replica ``i > 0`` suffixes them (``scheduler.1``, ...).
Each member finds its partners by its own name: ``peer_of("scheduler.1", "worker")``
is ``worker.1``.

With prefill/decode disaggregation (``--prefill-replicas M``) the replicas numbered from
``dp_size`` on are prefill replicas: the router never sends them requests, decode
schedulers hand them prompts (``messages/kv.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import RouterConfig

__all__ = [
    "REPLICA_ROLES",
    "base_role",
    "is_prefill_role",
    "parse_cpus",
    "peer_of",
    "prefill_schedulers",
    "replica_count",
    "replica_index",
    "replica_members",
    "replica_role",
]

REPLICA_ROLES = ("scheduler", "cache_manager", "worker")


def replica_role(base: str, index: int) -> str:
    """``base``'s role name in replica ``index``."""
    return base if index == 0 else f"{base}.{index}"


def base_role(role: str) -> str:
    """The role without its replica suffix: ``worker.1`` → ``worker``."""
    head, dot, tail = role.rpartition(".")
    return head if dot and tail.isdigit() and head else role


def replica_index(role: str) -> int:
    """The replica a role belongs to (0 for plain names)."""
    head, dot, tail = role.rpartition(".")
    return int(tail) if dot and tail.isdigit() and head else 0


def peer_of(role: str, base: str) -> str:
    """The ``base`` member of ``role``'s replica."""
    return replica_role(base, replica_index(role))


def replica_members(index: int) -> tuple[str, ...]:
    return tuple(replica_role(r, index) for r in REPLICA_ROLES)


def replica_count(router: RouterConfig) -> int:
    """Every replica: the data-parallel (decode) ones, then the prefill ones."""
    return router.dp_size + router.prefill_replicas


def prefill_schedulers(router: RouterConfig) -> list[str]:
    return [replica_role("scheduler", i) for i in range(router.dp_size, replica_count(router))]


def is_prefill_role(role: str, router: RouterConfig) -> bool:
    """Whether ``role`` is a member of a prefill replica."""
    return base_role(role) in REPLICA_ROLES and replica_index(role) >= router.dp_size


def parse_cpus(spec: str) -> set[int]:
    """``"0"``, ``"2-3"``, ``"0,4-5"`` → the CPU numbers (ValueError when malformed)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"bad CPU list {spec!r}: use forms like 0, 2-3 or 0,4-5")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"bad CPU list {spec!r}: {part} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus
