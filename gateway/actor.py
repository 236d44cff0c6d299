"""The gateway as an actor: the HTTP server and the pipeline's client end, in one process.

Under ``actorlm serve`` it is a supervised child like the others (restarted on a
crash while the actors keep their state); with ``serve --deploy`` it runs alone
beside actors started with ``actorlm actor``. Either way it binds the HTTP port
first, so ``/health`` answers 503 at once, and it is ready when it has heard from
every pipeline actor; from then on ``/health`` follows their liveness, naming any
that is down. Told to stop, it stops accepting, lets the streams in flight finish
for ``drain_timeout_s``, ends the rest as aborted, then closes. ``POST /drain``
starts that stop from the HTTP side: new requests get 503 at once, and the gateway
asks its supervisor to stop the deployment (``StopDeployment``), or, run alone,
calls ``on_drain``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable

from aiohttp import web

from ..actors.client import ClientActor, EngineClient, pipeline_roles
from ..actors.runtime import ActorError
from ..config import EngineConfig
from ..messages.control import Ack, RestartMembers, StopDeployment
from ..messages.generate import FinishReason, TextDelta
from .app import build_app
from .params import ModelLimits
from .state import GatewayState

__all__ = ["GatewayActor", "say"]

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1.0  # for aiohttp to close connections once the streams have ended


def say(message: str) -> None:
    """A line for the operator (errors on stderr)."""
    out = sys.stderr if message.startswith("actorlm: error") else sys.stdout
    print(message, file=out, flush=True)


class GatewayActor(ClientActor):
    def __init__(self, config: EngineConfig, role: str = "gateway") -> None:
        super().__init__(config, role)
        model = config.model
        self.state = GatewayState(config, ModelLimits(model.vocab_size, model.max_model_len))
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._down: set[str] = set()  # pipeline roles seen going down, not back yet
        self.on_drain: Callable[[], None] | None = None  # run alone: how POST /drain stops
        self.state.request_stop = self._request_stop

    @property
    def url(self) -> str:
        return f"http://{self.config.server.host}:{self.config.server.port}"

    async def on_start(self) -> None:
        if self.runtime.options.supervisor:  # a launcher's child: it restarts replicas
            self.state.restart_members = self._restart_members
        self._runner = web.AppRunner(
            build_app(self.state),
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_GRACE_S,
            access_log=None,
        )
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.config.server.host, self.config.server.port)
        await self._site.start()
        self.state.client = EngineClient(self)
        self.spawn(self._until_ready(), name="gateway-ready")

    async def _until_ready(self) -> None:
        """Ready once every pipeline actor has been heard from; say which we wait for."""
        started, told = time.monotonic(), 0.0
        roles = pipeline_roles(self.config)
        while missing := [r for r in roles if r not in self.runtime.peers.up]:
            now = time.monotonic()
            if now - told > 10:
                say(f"actorlm: waiting for {', '.join(missing)}")
                told = now
            if now - started > self.config.deploy.start_timeout_s:
                say(
                    f"actorlm: error: {', '.join(missing)} did not come up within "
                    f"{self.config.deploy.start_timeout_s:g}s"
                )
                self.state.startup_error = f"{', '.join(missing)} never came up"
                self.runtime.stop()
                return
            await asyncio.sleep(0.1)
        await self._learn_model()
        self.state.ready = True
        say(f"actorlm serving {self.state.model_name} at {self.url}")

    async def _learn_model(self) -> None:
        client = self.state.client
        assert client is not None
        try:
            self.state.model_facts = await client.info("worker")
        except ActorError as exc:
            log.warning("could not read the worker's model facts: %s", exc)
            return
        try:
            self.state.tokenizer_facts = await client.info("tokenizer")
        except ActorError as exc:
            log.warning("could not read the tokenizer's facts: %s", exc)
        vocab = self.state.model_facts.get("vocab_size")
        if isinstance(vocab, int) and vocab > 0:  # the worker knows the padded vocabulary
            self.state.limits = ModelLimits(vocab, self.state.limits.max_model_len)

    async def on_peer_down(self, role: str, reason: str) -> None:
        await super().on_peer_down(role, reason)
        if role in pipeline_roles(self.config):
            self.state.metrics.actor_downs.labels(role=role).inc()
            self._down.add(role)

    async def on_peer_up(self, role: str) -> None:
        if role in self._down:
            self._down.discard(role)
            self.state.metrics.actor_restarts.labels(role=role).inc()
        if role == "worker" and self.state.ready:
            await self._learn_model()

    def _request_stop(self, reason: str) -> None:
        """Stop the deployment this gateway fronts: its supervisor's, or (alone) ours."""
        self.state.draining = True
        supervisor = self.runtime.options.supervisor
        if supervisor:
            self.spawn(self.send(supervisor, StopDeployment(reason=reason)), name="drain")
        elif self.on_drain is not None:
            self.on_drain()
        else:
            self.runtime.stop_gracefully()

    async def _restart_members(self, roles: list[str]) -> str:
        """Have the supervisor restart ``roles``; "" once they are back, else why not."""
        supervisor = self.runtime.options.supervisor
        timeout = self.config.deploy.start_timeout_s + 10.0
        msg = RestartMembers(roles=roles, reason="POST /drain_replica")
        try:
            reply = await self.request(supervisor, msg, timeout=timeout)
        except ActorError as exc:
            return str(exc)
        if not isinstance(reply, Ack):
            return f"unexpected reply {reply.TAG}"
        return "" if reply.ok else reply.detail

    async def before_stop(self) -> None:
        self.state.draining = True
        # The listener stays open while streams finish: new requests get 503
        # shutting_down and /health "draining" (a load balancer's probe sees why).
        await self._drain(self.config.server.drain_timeout_s)
        if self._site is not None:
            await self._site.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def on_stop(self) -> None:
        if self._runner is not None:  # stopped without a drain (the parent is gone)
            await self._runner.cleanup()

    async def _drain(self, timeout: float) -> None:
        """Wait for the requests in flight, then end the rest as aborted (each client
        gets a proper end of its stream)."""
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        rids = list(self.streams)
        if rids:
            log.warning("shutting down: aborting %d request(s) still in flight", len(rids))
        for rid in rids:
            queue = self.streams.get(rid)
            if queue is not None:
                queue.put_nowait(TextDelta(rid=rid, finish_reason=FinishReason.ABORT))
        client = self.state.client
        if client is not None:
            await asyncio.gather(*(client.abort(rid) for rid in rids), return_exceptions=True)
        while self.streams and time.monotonic() < deadline + SHUTDOWN_GRACE_S:
            await asyncio.sleep(0.02)
