"""The built-in actor roles, registered lazily so a process imports only its own actor."""

from __future__ import annotations

from .runtime.child import ACTOR_ROLES

__all__: list[str] = []

ACTOR_ROLES.register("tokenizer", "actorlm.actors.tokenizer.actor:TokenizerActor", source="builtin")
ACTOR_ROLES.register("scheduler", "actorlm.actors.scheduler.actor:SchedulerActor", source="builtin")
ACTOR_ROLES.register(
    "cache_manager", "actorlm.actors.cache.actor:CacheManagerActor", source="builtin"
)
ACTOR_ROLES.register("worker", "actorlm.actors.worker.actor:WorkerActor", source="builtin")
ACTOR_ROLES.register(
    "lora_loader", "actorlm.actors.lora_loader.actor:LoraLoaderActor", source="builtin"
)
# By name only: the gateway sits above the actors and is imported in its own process alone.
ACTOR_ROLES.register("gateway", "actorlm.gateway.actor:GatewayActor", source="builtin")
