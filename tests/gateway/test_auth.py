"""Keys at the gateway: clients' --api-key, and --admin-api-key for the control routes
(in-process app, no engine: the answer is decided before any handler needs one)."""

from __future__ import annotations

import asyncio

import pytest
from actorlm.config import EngineConfig, ModelConfig, ServerConfig
from actorlm.gateway.app import build_app
from actorlm.gateway.params import ModelLimits
from actorlm.gateway.state import GatewayState
from aiohttp.test_utils import TestClient, TestServer


def statuses(server: ServerConfig, calls: list[tuple[str, str, str]]) -> list[int]:
    config = EngineConfig(model=ModelConfig(path="/m", max_model_len=64), server=server)

    async def main() -> list[int]:
        client = TestClient(TestServer(build_app(GatewayState(config, ModelLimits(100, 64)))))
        await client.start_server()
        try:
            out = []
            for method, path, key in calls:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                resp = await client.request(method, path, headers=headers, json={})
                out.append(resp.status)
            return out
        finally:
            await client.close()

    return asyncio.run(main())


@pytest.mark.parametrize("path", ["/flush_cache", "/abort_request"])
def test_control_routes_take_the_admin_key(path: str) -> None:
    server = ServerConfig(api_key="client", admin_api_key="admin")
    got = statuses(server, [("POST", path, "client"), ("POST", path, "admin"), ("POST", path, "")])
    assert got[0] == 401 and got[2] == 401
    assert got[1] == 503  # past auth: the engine is not up in this test
    # A client's route still takes the client's key, not the admin's.
    body = [("POST", "/v1/completions", "admin"), ("GET", "/v1/models", "client")]
    assert statuses(server, body) == [401, 200]


def test_without_an_admin_key_control_routes_take_the_api_key() -> None:
    server = ServerConfig(api_key="client")
    assert statuses(
        server, [("POST", "/flush_cache", "client"), ("POST", "/flush_cache", "x")]
    ) == [
        503,
        401,
    ]
    assert statuses(server, [("GET", "/health", ""), ("GET", "/openapi.json", "")]) == [503, 200]
