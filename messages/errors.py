"""Why a request failed, as a typed code every actor and client reads the same way.

A request that fails ends with a delta whose ``error_code`` names the cause; the
gateway turns the code into its HTTP status and OpenAI error ``code``, so no
part of the system guesses a status from an error's text.
"""

from __future__ import annotations

import enum

__all__ = ["HTTP_STATUS", "ErrorCode", "code_for_status"]


class ErrorCode(enum.StrEnum):
    INVALID_REQUEST = "invalid_request"  # the client's fault: bad parameters, bad prompt
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max tokens past the context
    NOT_FOUND = "not_found"  # an unknown model or adapter
    TOO_LARGE = "too_large"  # bigger than the server will ever take
    OVERLOADED = "overloaded"  # full right now: try again later
    UNAVAILABLE = "unavailable"  # a part of the engine is down or restarting
    TIMEOUT = "timeout"  # waited longer than allowed
    INTERNAL = "internal_error"  # our fault


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.INTERNAL: 500,
}


def code_for_status(status: int) -> ErrorCode:
    """The code for an error that arrives as an HTTP-like status (an actor's
    ``ErrorReply``, an interceptor's ``Reject``)."""
    return {
        400: ErrorCode.INVALID_REQUEST,
        404: ErrorCode.NOT_FOUND,
        413: ErrorCode.TOO_LARGE,
        429: ErrorCode.OVERLOADED,
        503: ErrorCode.UNAVAILABLE,
        504: ErrorCode.TIMEOUT,
    }.get(status, ErrorCode.INVALID_REQUEST if 400 <= status < 500 else ErrorCode.INTERNAL)
