"""No input gets a 5xx: schemathesis over /openapi.json, hypothesis bodies for every
POST route, and the hostile cases found by hand (deep JSON, huge integers, oversized
chunked and compressed bodies, bad encodings, lone surrogates, huge n, templates sent
with a request). After all of it the server still answers, and nothing leaked: no
request in flight, no KV page held (issue 17)."""

from __future__ import annotations

import gzip
import http.client
import json
import urllib.parse
from typing import Any

import pytest
import schemathesis
from actorlm.gateway.openapi import openapi_document
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Server
from .test_errors import call

pytestmark = pytest.mark.timeout(900)

# Short generations: the fuzzing is about the edges, not the model.
# Every documented route but /drain, which stops the server (tests/test_drain.py).
SCHEMA = schemathesis.openapi.from_dict(openapi_document("fuzz", max_tokens=8)).exclude(
    path="/drain"
)
ROUTES = ["/v1/completions", "/v1/chat/completions", "/generate", "/abort_request", "/flush_cache"]
FIELDS = [
    "prompt", "messages", "text", "input_ids", "sampling_params", "max_tokens", "n", "stop",
    "temperature", "top_p", "logit_bias", "logprobs", "top_logprobs", "stream", "seed",
    "chat_template_kwargs", "chat_template", "rid", "model", "stop_token_ids", "min_tokens",
]  # fmt: skip
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6)


@SCHEMA.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_5xx(case: Any, server: Server) -> None:
    response = case.call(base_url=server.url, headers=server.headers, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.text[:500]}"


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES)
def test_arbitrary_json_bodies_get_no_5xx(server: Server, route: str, body: dict[str, Any]) -> None:
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 8)
    status, answer, _ = call(server, "POST", route, json=body)
    assert status < 500, (route, body, answer)


def _raw(server: Server, body: bytes, headers: dict[str, str], chunked: bool = False) -> int:
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {**server.headers, "Content-Type": "application/json", **headers}
    if chunked:
        conn.putrequest("POST", "/v1/completions")
        for key, value in {**headers, "Transfer-Encoding": "chunked"}.items():
            conn.putheader(key, value)
        conn.endheaders()
        for start in range(0, len(body), 65536):
            piece = body[start : start + 65536]
            conn.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        conn.send(b"0\r\n\r\n")
    else:
        conn.request("POST", "/v1/completions", body=body, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def test_oversized_and_undecodable_bodies(server: Server) -> None:
    big = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
    assert _raw(server, big, {}, chunked=True) == 413  # no Content-Length to refuse it by
    bomb = gzip.compress(b'{"prompt": "' + b"a" * (64 * 2**20) + b'"}')
    assert len(bomb) < 2**20
    assert _raw(server, bomb, {"Content-Encoding": "gzip"}) == 413  # stops at the limit
    seen = len(server.log_text())
    assert _raw(server, b"not gzip at all", {"Content-Encoding": "gzip"}) == 400
    torn = gzip.compress(b'{"prompt": "' + b"a" * 4096 + b'"}')[:-40] + b"x" * 40
    assert _raw(server, torn, {"Content-Encoding": "gzip"}) == 400
    assert "Traceback" not in server.log_text()[seen:]  # a client's error, not the server's
    assert _raw(server, b'{"prompt": "x"}', {"Content-Encoding": "nonsense"}) in (200, 400, 415)


SURROGATE = "\ud800"
HOSTILE: list[tuple[str, Any]] = [
    ("/v1/completions", b"[" * 20000 + b"]" * 20000),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("/v1/completions", b'{"prompt": NaN}'),
    ("/v1/completions", {"prompt": "x", "n": 1_000_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2**31}),
    ("/generate", {"text": "x", "sampling_params": {"n": 10**6}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"x": 10**30}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template": "{% for i in range(99999) %}{% endfor %}"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
]  # fmt: skip
for route in ("/v1/completions", "/generate"):
    key = "prompt" if route == "/v1/completions" else "text"
    HOSTILE += [(route, {key: SURROGATE}), (route, {key: "x", "stop": [SURROGATE]})]
HOSTILE += [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": SURROGATE}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "user": SURROGATE}),
    ("/generate", {"text": "x", "rid": SURROGATE}),
    ("/abort_request", {"rid": SURROGATE}),
]


@pytest.mark.parametrize(("route", "body"), HOSTILE)
def test_hostile_bodies_get_a_clear_4xx(server: Server, route: str, body: Any) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # \ud800 as JSON escapes
    status, payload, _ = call(
        server,
        "POST",
        route,
        data=data,
        headers={**server.headers, "Content-Type": "application/json"},
    )
    assert 400 <= status < 500, (status, payload)
    assert payload["error"]["message"], payload


def test_after_the_fuzz_it_serves_and_holds_nothing(server: Server) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    status, payload, _ = call(server, "POST", "/v1/completions", json=body)
    assert status == 200 and payload["choices"][0]["finish_reason"] == "length"
    status, info, _ = call(server, "GET", "/get_server_info")
    assert status == 200 and info["in_flight"] == 0
    cache = info["stats"]["cache_manager"]
    assert cache["consistent"] and cache["running_requests"] == 0 and cache["pages_private"] == 0
    assert info["stats"]["scheduler"]["running"] == 0 and info["stats"]["scheduler"]["queued"] == 0
