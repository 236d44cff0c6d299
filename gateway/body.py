"""Reading a request body as JSON, within limits, so no body can crash or stall the
gateway: at most ``max_body_bytes`` after decompression (a gzip bomb stops at the
limit), a clear 400 for a body that cannot be decoded, and a parsed document that
every later step can handle: nested at most ``MAX_DEPTH`` deep, integers that fit
the 64 bits every actor encodes, strings that are valid UTF-8 (no lone surrogates,
which msgpack cannot carry), and no NaN or Infinity (not JSON)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from .errors import ApiError

__all__ = ["MAX_DEPTH", "parse_json", "read_body", "read_json"]

MAX_DEPTH = 64  # real request bodies nest a few levels; JSON schemas (tools) a dozen
_MAX_INT_DIGITS = 19  # 2**63 has 19 digits; the value check follows in _check
_INT64 = 2**63


async def read_body(request: web.Request, limit: int) -> bytes:
    """The (decompressed) body; 413 past ``limit`` bytes, 400 if it cannot be decoded."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(
            413,
            f"request body of {request.content_length} bytes is over the limit of {limit}",
            code="request_too_large",
        )
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                raise ApiError(
                    413,
                    f"request body is over the limit of {limit} bytes (after decompression)",
                    code="request_too_large",
                )
            chunks.append(chunk)
    except (ContentEncodingError, web.RequestPayloadError) as exc:
        # The body's stream is broken: marked read, or aiohttp reads it again after the
        # answer (its lingering close) and logs the client's error as its own; and the
        # connection ends, as nothing after a body that cannot be read can be trusted.
        request.content.feed_eof()
        encoding = request.headers.get("Content-Encoding", "none")
        raise ApiError(
            400,
            f"cannot read the request body (Content-Encoding: {encoding}): {exc}",
            code="invalid_encoding",
            close=True,
        ) from None
    return b"".join(chunks)


async def read_json(request: web.Request, limit: int) -> Any:
    return parse_json(await read_body(request, limit))


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits does not fit in 64 bits")
    return int(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes) -> Any:
    """``raw`` as a JSON document that fits the limits above, or a 400 saying why not."""
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        doc = json.loads(raw, parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(
            400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json"
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ApiError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    _check(doc)
    return doc


def _check(doc: Any) -> None:
    """Depth, integer range and string encodability, without recursion."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > MAX_DEPTH:
                raise ApiError(
                    400,
                    f"the request body nests deeper than {MAX_DEPTH} levels",
                    code="invalid_json",
                )
            for key, item in value.items():
                _check_str(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            if depth > MAX_DEPTH:
                raise ApiError(
                    400,
                    f"the request body nests deeper than {MAX_DEPTH} levels",
                    code="invalid_json",
                )
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_str(value)
        elif (
            isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64
        ):
            raise ApiError(400, f"the integer {value} does not fit in 64 bits", code="invalid_json")


def _check_str(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400,
            "the request body holds a string that is not valid Unicode (a lone surrogate such "
            "as \\ud800)",
            code="invalid_json",
        ) from None
