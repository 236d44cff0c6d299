"""What every handler shares: the config, the engine client once it exists, readiness."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from ..actors.client import EngineClient, blocking_down, pipeline_roles
from ..config import EngineConfig
from ..messages.generate import GenerateRequest
from .errors import ApiError
from .metrics import GatewayMetrics
from .params import ModelLimits
from .streams import Fanout

__all__ = ["STATE", "GatewayState", "served_model_name"]

DEFAULT_ALIAS = "default"


def served_model_name(config: EngineConfig) -> str:
    """``--served-model-name``, else the model folder's name or the GGUF file's stem."""
    if config.model.served_model_name:
        return config.model.served_model_name
    path = Path(config.model.path)
    if not config.model.path:
        return DEFAULT_ALIAS
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass
class GatewayState:
    config: EngineConfig
    limits: ModelLimits
    model_name: str = ""
    client: EngineClient | None = None
    ready: bool = False
    draining: bool = False
    startup_error: str = ""
    model_facts: dict[str, Any] = field(default_factory=dict)  # the worker's READY info
    tokenizer_facts: dict[str, Any] = field(default_factory=dict)  # the tokenizer's (templates)
    reserved: int = 0  # engine requests admitted and not finished
    # POST /drain: stop admitting at once, then stop the deployment (the gateway's own)
    request_stop: Callable[[str], None] | None = None
    # POST /drain_replica: the launcher restarts these roles; "" when done, else why not
    restart_members: Callable[[list[str]], Awaitable[str]] | None = None
    metrics: GatewayMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.model_name = self.model_name or served_model_name(self.config)
        self.metrics = GatewayMetrics(self.model_name)

    @property
    def aliases(self) -> set[str]:
        names = {self.model_name, DEFAULT_ALIAS}
        if self.config.model.path:
            names.add(self.config.model.path)
            names.add(Path(self.config.model.path).name)
        return names

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve (absent means the served one)."""
        if name is not None and name not in self.aliases:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                code="model_not_found",
                param="model",
            )

    def adapter_for(self, name: str | None, param: str = "model") -> str | None:
        """The LoRA adapter a request's ``model`` (or ``lora_path``) names: None for the
        base model (absent, or one of its names). With LoRA on, any other name goes to
        the lora_loader, which answers 404 for one it does not hold."""
        if name is None or (param == "model" and name in self.aliases):
            return None
        if not name and param == "lora_path":
            return None
        if self.config.lora.enabled:
            return name
        if param == "model":
            self.check_model(name)
        raise ApiError(
            404,
            f"no LoRA adapter named {name!r}: this server serves none (start it with "
            "--enable-lora or --lora-paths)",
            code="model_not_found",
            param=param,
        )

    def engine(self) -> EngineClient:
        """The client, or 503 while loading, after a failed start or while shutting down."""
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )
        if self.client is None or not self.ready:
            why = self.startup_error or "the model is still loading"
            raise ApiError(503, why, code="not_ready", headers={"Retry-After": "2"})
        down = blocking_down(self.config, self.client.actor.runtime.down)
        if down:  # the lora_loader is not among them: base requests need it not
            raise ApiError(
                503,
                f"actor(s) {', '.join(down)} are down; try again shortly",
                code="actor_down",
                headers={"Retry-After": "2"},
            )
        return self.client

    def down_roles(self) -> list[str]:
        """The pipeline actors (the lora_loader too, when LoRA is on) that are down now."""
        if self.client is None:
            return []
        return sorted(set(pipeline_roles(self.config)) & self.client.actor.runtime.down)

    def fanout(self, reqs: Sequence[GenerateRequest]) -> Fanout:
        """Run ``reqs`` if they fit under ``max_queued_requests`` (else 429). Their places
        are taken now, before anything awaits, so concurrent arrivals can never overshoot
        the limit; they are given back when the fan-out ends."""
        client = self.engine()
        limit = self.config.scheduler.max_queued_requests
        count = len(reqs)
        if limit > 0 and self.reserved + count > limit:
            raise ApiError(
                429,
                f"too many requests in flight ({self.reserved} of at most {limit}); retry later",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
        self.reserved += count

        def release() -> None:
            self.reserved -= count

        return Fanout(client, reqs, self.metrics, on_exit=release)


STATE = web.AppKey("actorlm_gateway_state", GatewayState)
