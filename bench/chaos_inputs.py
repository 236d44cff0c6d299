"""Bad requests for ``bench/chaos.py``: seeded, each a (path, body bytes, headers) that a
server must answer with a 4xx. Mutations of valid bodies (wrong types, out-of-range
values, lone surrogates, templates), broken JSON, and bodies no parser should trust
(deep nesting, huge integers, oversized or undecodable compressed bodies)."""

from __future__ import annotations

import gzip
import json
import random
from typing import Any

__all__ = ["bad_request"]

Request = tuple[str, bytes, dict[str, str]]

_VALID: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}),
]
_BAD_VALUES: list[Any] = [
    -1, 0, 10**30, -(10**30), 1.5, "many", True, None, [], {}, [[[]]], "\ud800", 1e308,
    {"a": "\udfff"}, "x" * 5000, [1] * 1000,
]  # fmt: skip
_FIELDS = [
    "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "logit_bias", "logprobs",
    "top_logprobs", "seed", "stream", "messages", "prompt", "text", "input_ids", "model",
    "sampling_params", "min_tokens", "presence_penalty", "chat_template_kwargs", "stop_token_ids",
]  # fmt: skip


def _mutated(rng: random.Random) -> Request:
    path, body = rng.choice(_VALID)
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        body[rng.choice(_FIELDS)] = rng.choice(_BAD_VALUES)
    # \ud800 survives json.dumps as an escape, as a hostile client would send it
    return path, json.dumps(body).encode(), {}


def _broken(rng: random.Random) -> Request:
    path, body = rng.choice(_VALID)
    raw = json.dumps(body).encode()
    cut = rng.randrange(1, len(raw))
    choice = rng.randrange(6)
    if choice == 0:
        data = raw[:cut]  # truncated
    elif choice == 1:
        data = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut:]  # a stray byte
    elif choice == 2:
        depth = rng.randint(100, 50_000)
        data = b"[" * depth + b"]" * depth
    elif choice == 3:
        data = b'{"prompt": "x", "max_tokens": ' + b"9" * rng.randint(20, 6000) + b"}"
    elif choice == 4:
        data = b'{"prompt": NaN, "temperature": Infinity}'
    else:
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    return path, data, {}


def _encoded(rng: random.Random) -> Request:
    choice = rng.randrange(3)
    if choice == 0:  # a gzip bomb: small on the wire, far over the limit inflated
        data = gzip.compress(b'{"prompt": "' + b"a" * (48 * 2**20) + b'"}', compresslevel=9)
        return "/v1/completions", data, {"Content-Encoding": "gzip"}
    if choice == 1:
        return "/v1/completions", b"\x1f\x8bnot gzip", {"Content-Encoding": "gzip"}
    return "/v1/completions", b'{"prompt": "x"}', {"Content-Encoding": "deflate"}


def bad_request(rng: random.Random) -> Request:
    """One bad request; ~70% mutated bodies, ~25% broken JSON, ~5% bad encodings."""
    roll = rng.random()
    if roll < 0.70:
        return _mutated(rng)
    if roll < 0.95:
        return _broken(rng)
    return _encoded(rng)
