"""Errors, auth, limits and disconnects against the real server: always OpenAI-shaped, never a 500."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp
import openai
import pytest

from .conftest import API_KEY, MAX_QUEUED, Server

pytestmark = pytest.mark.timeout(300)


async def _call(
    server: Server, method: str, path: str, *, headers: Any = None, **kw: Any
) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as session:
        hdrs = server.headers if headers is None else headers
        async with session.request(method, f"{server.url}{path}", headers=hdrs, **kw) as resp:
            body = (
                await resp.json(content_type=None)
                if resp.content_type != "text/plain"
                else await resp.text()
            )
            return resp.status, body, resp.headers


def call(server: Server, method: str, path: str, **kw: Any) -> tuple[int, Any, Any]:
    return asyncio.run(_call(server, method, path, **kw))


def assert_error(status: int, body: Any, expected: int, needle: str = "") -> None:
    assert status == expected, body
    err = body["error"]
    assert set(err) >= {"message", "type", "code"}
    assert needle.lower() in err["message"].lower()


@pytest.mark.parametrize(
    ("path", "payload", "expected", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"", 400, "empty"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
        ("/v1/completions", b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
        ("/v1/completions", b'{"prompt": "x", "presence_penalty": 9}', 400, "presence_penalty"),
        ("/v1/completions", b'{"prompt": "x", "model": "nope"}', 404, "nope"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, "2048"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "content"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "n": "2"}',
            400,
            "'n'",
        ),
        (
            "/generate",
            b'{"text": "x", "sampling_params": {"temperature": "hot"}}',
            400,
            "temperature",
        ),
        ("/generate", b'{"input_ids": [999999999]}', 400, "vocabulary"),
        ("/generate", b'{"sampling_params": {}}', 400, "text"),
    ],
)
def test_bad_requests(
    server: Server, path: str, payload: bytes, expected: int, needle: str
) -> None:
    status, body, _ = call(
        server,
        "POST",
        path,
        data=payload,
        headers={**server.headers, "Content-Type": "application/json"},
    )
    assert_error(status, body, expected, needle)


def test_prompt_too_long_names_the_limits(server: Server) -> None:
    status, body, _ = call(
        server, "POST", "/v1/completions", json={"prompt": [5] * 2040, "max_tokens": 20}
    )
    assert_error(status, body, 400, "2048")
    assert "2040" in body["error"]["message"]


def test_an_omitted_max_tokens_fits_what_the_prompt_leaves(server: Server) -> None:
    # 2,040 of the 2,048 tokens: the default (16 for completions, 128 for chat and
    # /generate) is lowered to the 8 left, where an asked-for 20 is refused above.
    status, body, _ = call(
        server, "POST", "/v1/completions", json={"prompt": [5] * 2040, "ignore_eos": True}
    )
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"
    native = {"input_ids": [5] * 2045, "sampling_params": {"ignore_eos": True}}
    status, body, _ = call(server, "POST", "/generate", json=native)
    assert status == 200 and body["meta_info"]["completion_tokens"] == 3, body
    status, body, _ = call(server, "POST", "/generate", json={"input_ids": [5] * 2048})
    assert_error(status, body, 400, "2048")  # nothing left for an answer


def test_body_too_large(server: Server) -> None:
    status, body, _ = call(server, "POST", "/v1/completions", data=b"x" * (9 * 1024 * 1024))
    assert_error(status, body, 413)


def test_unknown_route_and_method(server: Server) -> None:
    assert_error(*call(server, "GET", "/v2/nothing")[:2], 404)
    assert_error(*call(server, "GET", "/v1/completions")[:2], 405)


def test_too_many_queued_requests(server: Server) -> None:
    status, body, headers = call(
        server, "POST", "/v1/completions", json={"prompt": "x", "n": MAX_QUEUED + 1}
    )
    assert_error(status, body, 429)
    assert headers["Retry-After"]


def test_auth(server: Server) -> None:
    assert_error(*call(server, "GET", "/v1/models", headers={})[:2], 401)
    assert_error(
        *call(server, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[:2], 401
    )
    assert call(server, "GET", "/health", headers={})[0] == 200
    assert call(server, "GET", "/metrics", headers={})[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY).models.list().data


def test_openai_client_sees_typed_errors(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nothing", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="x", temperature=-1)
    assert "temperature" in str(info.value)


def _engine_idle(server: Server) -> dict[str, Any]:
    status, info, _ = call(server, "GET", "/get_server_info")
    assert status == 200
    return info


def _left_mid_stream(server: Server) -> float:
    """``actorlm_http_requests_total`` of completions whose client left (status 499)."""
    status, text, _ = call(server, "GET", "/metrics")
    assert status == 200
    m = re.search(r'http_requests_total\{route="/v1/completions",status="499"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_disconnect_aborts_and_frees_pages(server: Server) -> None:
    left = _left_mid_stream(server)

    async def read_a_little_then_leave() -> int:
        body = {
            "model": server.model,
            "prompt": "Tell a long story",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        async with (
            aiohttp.ClientSession(headers=server.headers) as session,
            session.post(f"{server.url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            events = 0
            async for line in resp.content:
                events += line.startswith(b"data: ")
                if events >= 3:
                    break
        return events  # leaving the session closes the connection mid-stream

    assert asyncio.run(read_a_little_then_leave()) == 3
    deadline = time.monotonic() + 30
    while True:
        # The scheduler drops the request at once; its pages go back to the cache
        # manager with the next cache step, which may wait for a forward step.
        info = _engine_idle(server)
        stats = info["stats"]
        if (
            info["in_flight"] == 0
            and stats["scheduler"].get("running") == 0
            and stats["cache_manager"].get("running_requests") == 0
        ):
            break
        assert time.monotonic() < deadline, f"the request kept running after the disconnect: {info}"
        time.sleep(0.2)
    status, body, _ = call(server, "POST", "/flush_cache")
    assert status == 200 and body["success"], body
    cache = _engine_idle(server)["stats"]["cache_manager"]
    assert cache["pages_used"] == 0, cache
    assert _left_mid_stream(server) == left + 1  # counted as the client leaving


def test_fuzzed_bodies_never_500(server: Server) -> None:
    bodies: list[Any] = [
        None, 0, "s", [], {}, {"prompt": None}, {"prompt": {"a": 1}}, {"prompt": [[]]}, {"prompt": [1.5]},
        {"prompt": "x", "stop": {"a": 1}}, {"prompt": "x", "logit_bias": [1]}, {"prompt": "x", "seed": "1"},
        {"prompt": "x", "stream_options": 5, "stream": True}, {"prompt": "x", "n": 1e30}, {"prompt": "x", "top_k": -5},
        {"messages": [None]}, {"messages": [{"role": 5}]}, {"prompt": "x", "max_tokens": -1},
        {"prompt": "x", "logprobs": -1}, {"prompt": "x", "min_p": 3}, {"prompt": "x", "stop_token_ids": ["a"]},
    ]  # fmt: skip
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        for body in bodies:
            status, resp, _ = call(server, "POST", path, json=body)
            assert 400 <= status < 500, (path, body, status, resp)
            assert "error" in resp
    assert call(server, "GET", "/health")[0] == 200
