"""The built-in actor roles, registered lazily so a process imports only its own actor."""

from __future__ import annotations

from .supervisor import ACTOR_ROLES

__all__: list[str] = []

ACTOR_ROLES.register("tokenizer", "actorlm.actors.tokenizer:TokenizerActor", source="builtin")
ACTOR_ROLES.register("scheduler", "actorlm.actors.scheduler:SchedulerActor", source="builtin")
ACTOR_ROLES.register(
    "cache_manager", "actorlm.actors.cache_manager:CacheManagerActor", source="builtin"
)
ACTOR_ROLES.register("worker", "actorlm.actors.worker:WorkerActor", source="builtin")
