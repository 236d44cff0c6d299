"""Draining one data-parallel replica while the others serve (``--dp-size`` > 1).

``POST /drain_replica {"replica": i}`` takes replica ``i`` out of the router (nothing new
goes to it), waits for the requests it holds to finish (up to ``"timeout"`` seconds,
``--shutdown-timeout`` by default),
then has the launcher restart its scheduler, cache manager and worker (a planned restart:
an upgrade picks up new code or weights this way), and puts it back in the router. Not a
request fails: the other replicas take the traffic meanwhile. With ``"restart": false``
it stays out until ``POST /resume_replica {"replica": i}``, for actors started one by one
(``actorlm actor``), which no launcher here can restart.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from ..actors.replicas import replica_members
from ..actors.runtime import ActorError
from .body import read_json
from .errors import ApiError, from_actor_error
from .params import Fields
from .state import STATE, GatewayState

__all__ = ["routes"]

POLL_S = 0.05


async def _replica(request: web.Request) -> tuple[GatewayState, Fields, int]:
    state = request.app[STATE]
    f = Fields(await read_json(request, state.config.server.max_body_bytes))
    replica, count = f.int("replica"), state.config.router.dp_size
    if count < 2:
        raise ApiError(
            400, "this server has one replica (--dp-size 1): use /drain", param="replica"
        )
    if replica is None or not 0 <= replica < count:
        raise ApiError(400, f"'replica' must be one of 0 to {count - 1}", param="replica")
    return state, f, replica


async def _drain(state: GatewayState, replica: int, drain: bool) -> int:
    """Tell the router; the replica's load (requests routed there, not finished)."""
    try:
        return await state.engine().drain_replica(replica, drain)
    except ActorError as exc:
        raise from_actor_error(exc) from None


async def drain_replica(request: web.Request) -> web.Response:
    state, f, replica = await _replica(request)
    restart = f.bool("restart", True)
    timeout = f.float("timeout", state.config.server.drain_timeout_s)
    assert timeout is not None
    if timeout < 0:
        raise ApiError(400, "'timeout' must be at least 0 (seconds)", param="timeout")
    if restart and state.restart_members is None:
        raise ApiError(
            400,
            "no launcher here can restart a replica (its actors were started one by one): "
            "send restart: false, restart them yourself, then POST /resume_replica",
            param="restart",
        )
    start = time.monotonic()
    deadline = start + timeout
    load = await _drain(state, replica, True)
    while load and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        load = await _drain(state, replica, True)
    body: dict[str, Any] = {"replica": replica, "drained": load == 0, "in_flight": load}
    if restart:
        assert state.restart_members is not None
        error = await state.restart_members(list(replica_members(replica)))
        if error:  # it stays out of the router: the others keep serving
            raise ApiError(503, f"replica {replica} was drained but not restarted: {error}")
        await _drain(state, replica, False)
    body.update(restarted=bool(restart), seconds=round(time.monotonic() - start, 3))
    return web.json_response(body)


async def resume_replica(request: web.Request) -> web.Response:
    state, _, replica = await _replica(request)
    load = await _drain(state, replica, False)
    return web.json_response({"replica": replica, "draining": False, "in_flight": load})


def routes() -> list[web.RouteDef]:
    return [web.post("/drain_replica", drain_replica), web.post("/resume_replica", resume_replica)]
