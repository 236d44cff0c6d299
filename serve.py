"""``actorlm serve``: the actors, one client runtime, and the HTTP server, in one call.

The HTTP port is bound before the actors start, so load balancers and users see
``/health`` answer 503 ("loading") at once rather than a refused connection;
it turns 200 when every actor is READY. SIGINT/SIGTERM: stop accepting, let
in-flight streams finish for ``drain_timeout_s``, end the rest as aborted, then
stop every actor process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from typing import Any

from aiohttp import web

from .actors.client import PIPELINE_ROLES, ClientActor, EngineClient
from .actors.runtime import ActorError, ActorRuntime, RuntimeOptions
from .actors.runtime.process import event_loop_runner, setup_logging
from .actors.runtime.supervisor import Launcher
from .actors.runtime.transport import ZmqTransport, free_port
from .config import EngineConfig
from .gateway.app import build_app
from .gateway.params import ModelLimits
from .gateway.state import GatewayState
from .gpu.model_info import load_model_info
from .launch import load_deployment
from .messages.control import Ping
from .messages.generate import TextDelta

__all__ = ["serve", "serve_async"]

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1.0  # for aiohttp to close connections once the streams have ended


def serve(config: EngineConfig, deploy: str | None = None) -> None:
    """Serve ``config`` (already resolved) until SIGINT or SIGTERM. With ``deploy`` (a
    deployment file) the actors run elsewhere and are reached at its addresses."""
    setup_logging(config.log_level)
    event_loop_runner()(serve_async(config, deploy=deploy))


def _limits(config: EngineConfig) -> ModelLimits:
    info = load_model_info(config.model.path)  # config.json or GGUF metadata only: cheap
    return ModelLimits(
        vocab_size=info.vocab_size, max_model_len=config.model.max_model_len or info.max_model_len
    )


def _say(message: str) -> None:
    print(
        message, file=sys.stderr if message.startswith("actorlm: error") else sys.stdout, flush=True
    )


async def _report_progress(launcher: Launcher, started: float) -> None:
    """One line per actor as it becomes ready: loading a model can take a while."""
    pending = dict(launcher.members)
    while pending:
        await asyncio.sleep(0.1)
        for role in [r for r, m in pending.items() if m.ready.is_set()]:
            pending.pop(role)
            done = len(launcher.members) - len(pending)
            _say(
                f"actorlm: {role} ready ({done}/{len(launcher.members)}, {time.monotonic() - started:.1f}s)"
            )


async def _drain(state: GatewayState, timeout: float) -> None:
    """Wait for in-flight requests, then end the rest as aborted (the clients get a proper end)."""
    client = state.client
    if client is None:
        return
    deadline = time.monotonic() + timeout
    while client.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    rids = list(client.actor.streams)
    if rids:
        log.warning("shutting down: aborting %d request(s) still in flight", len(rids))
    for rid in rids:
        queue = client.actor.streams.get(rid)
        if queue is not None:
            queue.put_nowait(TextDelta(rid=rid, finish_reason="abort"))
    await asyncio.gather(*(client.abort(rid) for rid in rids), return_exceptions=True)
    while client.in_flight and time.monotonic() < deadline + SHUTDOWN_GRACE_S:
        await asyncio.sleep(0.02)


def _client_runtime(
    config: EngineConfig, deploy: str | None
) -> tuple[Launcher | None, ActorRuntime]:
    """The gateway's client runtime: next to a launcher of our own, or, with a
    deployment file, connected to actors that ``actorlm actor`` started elsewhere."""
    actor = ClientActor(config)
    options = RuntimeOptions(request_timeout_s=config.deploy.request_timeout_s)
    if deploy is None:
        launcher = Launcher(config, list(PIPELINE_ROLES))
        options.book = dict(launcher.book)
        runtime = ActorRuntime(actor, launcher.new_address(actor.role), launcher.transport, options)
        launcher.attach(runtime)
        return launcher, runtime
    deployment = load_deployment(deploy, config)
    options.book = dict(deployment.addresses)
    address = f"tcp://{config.server.host}:{free_port(config.server.host)}"
    return None, ActorRuntime(actor, address, ZmqTransport(), options)


async def _wait_for_actors(runtime: ActorRuntime, timeout: float) -> None:
    """Actors started elsewhere are ready when they answer a ping."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for role in PIPELINE_ROLES:
        while True:
            try:
                await runtime.request(role, Ping(), timeout=1.0)
                break
            except ActorError:
                if loop.time() > deadline:
                    raise TimeoutError(f"actor {role} did not answer within {timeout:g}s") from None
                await asyncio.sleep(0.2)


async def serve_async(
    config: EngineConfig, *, deploy: str | None = None, stop: asyncio.Event | None = None
) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)

    state = GatewayState(config, _limits(config))
    runner = web.AppRunner(
        build_app(state),
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        access_log=None,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port)
    await site.start()
    url = f"http://{config.server.host}:{config.server.port}"
    started = time.monotonic()
    _say(f"actorlm: loading {config.model.path} (health at {url}/health answers 503 until ready)")

    launcher, runtime = _client_runtime(config, deploy)
    actor = runtime.actor
    assert isinstance(actor, ClientActor)
    tasks: list[asyncio.Task[Any]] = [asyncio.create_task(runtime.serve(), name="gateway-client")]
    progress = asyncio.create_task(_report_progress(launcher, started)) if launcher else None
    try:
        await runtime.ready.wait()
        if launcher is not None:
            start = asyncio.create_task(launcher.start())
        else:
            start = asyncio.create_task(
                _wait_for_actors(runtime, config.deploy.request_timeout_s * 10)
            )
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start.done() and start.exception() is None:
            if progress is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(progress, 1.0)  # print the last "ready" line first
            state.client = EngineClient(actor)
            with contextlib.suppress(Exception):
                state.model_facts = await state.client.info("worker")
            state.limits = _refine(state.limits, state.model_facts)
            state.ready = True
            _say(f"actorlm serving {state.model_name} at {url}")
            await stopper
        elif start.done():
            state.startup_error = f"startup failed: {start.exception()}"
            _say(f"actorlm: error: {state.startup_error}")
        else:
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
        stopper.cancel()
    finally:
        if progress is not None:
            progress.cancel()
        _say("actorlm: shutting down")
        state.draining = True
        await site.stop()  # no new connections
        await _drain(state, config.server.drain_timeout_s)
        await runner.cleanup()
        runtime.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        if launcher is not None:
            await launcher.stop()
        else:
            runtime.transport.close()  # ours alone: no launcher shares it
        _say("actorlm: stopped")
    if state.startup_error:
        raise SystemExit(1)


def _refine(limits: ModelLimits, facts: dict[str, Any]) -> ModelLimits:
    """The worker's view wins where it reports one (it knows the padded vocabulary)."""
    vocab = facts.get("vocab_size")
    return ModelLimits(
        vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else limits.vocab_size,
        max_model_len=limits.max_model_len,
    )
