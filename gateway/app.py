"""The aiohttp application: routes, and the middlewares every request passes.

Order, outermost first: errors (anything raised below becomes an OpenAI-shaped
answer, and is counted), then auth. A handler's own bugs are logged with their
traceback and answered 500 without details; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from . import lora, native, openai, openapi, replicas
from .errors import ApiError, error_response
from .metrics import CONTENT_TYPE_LATEST
from .state import STATE, GatewayState

__all__ = ["CONTROL_PATHS", "OPEN_PATHS", "build_app"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Probes and scrapers carry no key (as with vLLM and SGLang).
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
# Routes that change the server's state: with --admin-api-key they need that key instead.
CONTROL_PATHS = frozenset(
    {
        "/abort_request",
        "/drain",
        "/drain_replica",
        "/resume_replica",
        "/flush_cache",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)


def _route_label(request: web.Request) -> str:
    """The route's pattern, so unknown paths cannot blow up the metric's label set."""
    info = request.match_info
    resource = info.route.resource if info.http_exception is None else None
    return resource.canonical if resource is not None else "unmatched"


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> ApiError:
    status = exc.status
    if status == 404:
        return ApiError(404, f"no route for {request.method} {request.path}", code="not_found")
    if status == 405:
        return ApiError(
            405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed"
        )
    if status == 413:
        return ApiError(413, f"request body is too large: {exc.text}", code="request_too_large")
    return ApiError(status, exc.text or exc.reason, code=None)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        response = await handler(request)
    except ApiError as exc:
        response = error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(_from_http_exception(request, exc))
    except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
        # The client went away mid-stream (aiohttp cancels the handler of a closed
        # connection: handler_cancellation); there is nobody to answer.
        state.metrics.http_requests.labels(route=_route_label(request), status="499").inc()
        raise
    except Exception:
        log.exception("unexpected error in %s %s", request.method, request.path)
        response = error_response(
            ApiError(500, "internal server error; see the server log", code="internal_error")
        )
    state.metrics.http_requests.labels(
        route=_route_label(request), status=str(response.status)
    ).inc()
    return response


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    server = request.app[STATE].config.server
    key, admin = server.api_key, server.admin_api_key
    if request.path in CONTROL_PATHS and admin:
        key = admin  # the operator's key, not the clients'
    if (
        key
        and request.path not in OPEN_PATHS
        and not hmac.compare_digest(_bearer(request).encode(), key.encode())
    ):
        what = "admin API key" if key is admin and admin else "API key"
        raise ApiError(
            401,
            f"invalid or missing {what}; send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return await handler(request)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    client = state.client
    stats = {}
    if client is not None and state.ready:
        try:
            stats = await client.stats()
        except Exception:  # a scrape must never fail because an actor is busy or gone
            log.warning("could not read actor stats for /metrics", exc_info=True)
    state.metrics.fill_stats(stats, client.in_flight if client else 0, state.ready)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(state: GatewayState) -> web.Application:
    app = web.Application(
        client_max_size=state.config.server.max_body_bytes,
        middlewares=[errors_middleware, auth_middleware],
    )
    app[STATE] = state
    app.add_routes(openai.routes())
    app.add_routes(native.routes())
    app.add_routes(lora.routes())
    app.add_routes(replicas.routes())
    app.add_routes(openapi.routes())
    app.add_routes([web.get("/metrics", metrics)])
    return app
