"""``actorlm serve``: every actor and the gateway, supervised.

This process is the supervisor and nothing else: it starts the gateway (which binds
the HTTP port at once, so ``/health`` answers 503 while the model loads) and the
pipeline actors, each in a process of its own; it restarts whichever dies, the
gateway included, while the others keep their state. SIGINT/SIGTERM or ``POST
/drain``: the gateway stops accepting and drains for ``drain_timeout_s``
(``--shutdown-timeout``), then every actor stops and the process exits.

With a deployment file (``serve --deploy cluster.toml``) the actors run elsewhere
(``actorlm actor ROLE --deploy cluster.toml``) and this process runs the gateway
alone, reaching them at the file's addresses.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

from .actors.client import pipeline_roles
from .actors.runtime import ActorRuntime, RuntimeOptions
from .actors.runtime.process import event_loop_runner, setup_logging
from .actors.runtime.ray_launcher import make_launcher
from .actors.runtime.transport import ZmqTransport, free_port
from .config import EngineConfig
from .gateway.actor import GatewayActor, say
from .launch import Deployment

__all__ = ["serve", "serve_async"]


def serve(config: EngineConfig, deployment: Deployment | None = None) -> int:
    """Serve ``config`` (already resolved) until SIGINT or SIGTERM; the exit status."""
    setup_logging(config.log_level)
    return event_loop_runner()(serve_async(config, deployment))


def _on_signals(callback: object) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, callback)  # type: ignore[arg-type]


async def serve_async(
    config: EngineConfig, deployment: Deployment | None = None, stop: asyncio.Event | None = None
) -> int:
    stop = stop or asyncio.Event()
    _on_signals(stop.set)
    if deployment is not None:
        return await _gateway_alone(config, deployment, stop)
    url = f"http://{config.server.host}:{config.server.port}"
    say(f"actorlm: loading {config.model.path} (health at {url}/health answers 503 until ready)")
    launcher = make_launcher(config, ["gateway", *pipeline_roles(config)])
    started = time.monotonic()
    total = len(launcher.members)

    def ready(role: str) -> None:
        done = sum(m.ready.is_set() for m in launcher.members.values())
        say(f"actorlm: {role} ready ({done}/{total}, {time.monotonic() - started:.1f}s)")

    launcher.on_ready = ready
    launcher.on_stop_requested = stop.set  # POST /drain: as SIGTERM
    start = asyncio.create_task(launcher.start())
    stopper = asyncio.create_task(stop.wait())
    status = 0
    try:
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start.done() and start.exception() is not None:
            say(f"actorlm: error: startup failed: {start.exception()}")
            status = 1
        elif start.done():
            await stopper
    finally:
        stopper.cancel()
        if not start.done():
            start.cancel()  # the launcher stops what it started
        await asyncio.gather(start, return_exceptions=True)
        say("actorlm: shutting down")
        await launcher.stop()
        say("actorlm: stopped")
    return status


async def _gateway_alone(config: EngineConfig, deployment: Deployment, stop: asyncio.Event) -> int:
    """The gateway in this process, beside actors started elsewhere."""
    actor = GatewayActor(config)
    actor.on_drain = stop.set  # POST /drain: as SIGTERM
    book = dict(deployment.addresses)
    address = book.get("gateway") or f"tcp://{config.server.host}:{free_port(config.server.host)}"
    transport = ZmqTransport.for_deploy(config.deploy)
    options = RuntimeOptions.from_deploy(
        config.deploy, book=book, bind=deployment.binds.get("gateway", "")
    )
    runtime = ActorRuntime(actor, address, transport, options)
    say(
        f"actorlm: gateway at http://{config.server.host}:{config.server.port}, actors from the deployment file"
    )
    serving = asyncio.create_task(runtime.serve())
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            say("actorlm: shutting down")
            runtime.stop_gracefully()
        await serving
    finally:
        stopper.cancel()
        transport.close()
    say("actorlm: stopped")
    return 1 if actor.state.startup_error else 0
