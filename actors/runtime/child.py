"""One actor in a process of its own: ``python -m actorlm.actors.runtime.child`` (spawned by
the launcher, told what to be on stdin) and ``run_actor`` (also behind ``actorlm actor``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import cast

import msgspec

from ...config import EngineConfig
from ...extensions.registry import Registry, get_registry, import_object
from .dispatch import Actor, ActorRuntime, RuntimeOptions
from .transport import ZmqTransport

__all__ = ["ACTOR_ROLES", "ChildSpec", "build_actor", "child_main", "run_actor"]

log = logging.getLogger(__name__)

ACTOR_ROLES: Registry[type[Actor]] = get_registry(
    "actor role", "actorlm actor ROLE", interface="actorlm.actors.runtime.actor:Actor"
)


def build_actor(spec: str, config: EngineConfig) -> Actor:
    """``spec`` is a registered role name or a ``"module:Class"`` path. A replica's
    name (``scheduler.1``, see ``actors.replicas``) builds its role's actor under it."""
    if ":" in spec:
        return cast(type[Actor], import_object(spec))(config)
    from .. import roles  # noqa: F401  (registers the built-in roles)
    from ..replicas import base_role

    base = spec if spec in ACTOR_ROLES else base_role(spec)
    actor = ACTOR_ROLES.get(base)(config)
    if base != spec:
        # the instance's name, not its class's
        actor.role = spec  # type: ignore[misc]
    return actor


async def run_actor(
    spec: str,
    config: EngineConfig,
    address: str,
    book: dict[str, str],
    supervisor: str = "",
    parent_pid: int = 0,
    *,
    bind: str = "",
) -> None:
    """Run one actor until it is told to stop (SIGTERM, or Shutdown from its supervisor)
    or its parent process is gone."""
    transport = ZmqTransport.for_deploy(config.deploy)
    options = RuntimeOptions.from_deploy(config.deploy, supervisor=supervisor, book=book, bind=bind)
    actor = build_actor(spec, config)
    runtime = ActorRuntime(actor, address, transport, options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, *(() if parent_pid else (signal.SIGINT,))):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, runtime.stop_gracefully)

    async def orphan_watch() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(0.5)
        log.warning("%s: parent %d is gone; stopping", actor.role, parent_pid)
        runtime.stop()

    watch = asyncio.create_task(orphan_watch()) if parent_pid else None
    try:
        await runtime.serve()
    finally:
        if watch is not None:
            watch.cancel()
        transport.close()


class ChildSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a spawned actor process reads from its stdin."""

    spec: str
    config: EngineConfig
    address: str
    book: dict[str, str]
    supervisor: str
    parent: int
    sys_path: list[str]


def child_main() -> None:
    """One actor, told what to be on stdin. A fresh interpreter (not multiprocessing's
    spawn), so the parent's ``__main__`` is never re-imported: scripts without an
    ``if __name__ == "__main__"`` guard work."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    child = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=ChildSpec)
    sys.path[:] = list(dict.fromkeys([*child.sys_path, *sys.path]))
    from .process import event_loop_runner, prepare_process

    prepare_process(child.config, child.spec)
    try:
        event_loop_runner()(
            run_actor(
                child.spec, child.config, child.address, child.book, child.supervisor, child.parent
            )
        )
    except (ValueError, FileNotFoundError, PermissionError) as exc:
        # A setting that cannot work (an unknown name, a missing file): one line, no
        # traceback; the launcher then reports this actor's exit.
        log.debug("%s failed to start", child.spec, exc_info=True)
        print(f"actorlm: error: {child.spec}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    child_main()
