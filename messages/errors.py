"""Why something failed, as typed codes every actor and client reads the same way.

A request that fails ends with a delta whose ``error_code`` (an :class:`ErrorCode`)
names the cause; the gateway turns the code into its HTTP status and OpenAI error
``code``, so no part of the system guesses a status from an error's text.

A call from one actor to another that fails gets an ``ErrorReply`` whose ``code``
(a :class:`CallErrorCode`) says how the runtime or the handler failed it; the reply
carries its own HTTP-like status, since one code (``rejected``) comes with several.
The two stay apart because a call's code is not a request's: the gateway maps a
failed call to a request's code by its status (``code_for_status``).
"""

from __future__ import annotations

import enum

__all__ = ["HTTP_STATUS", "CallErrorCode", "ErrorCode", "code_for_status"]


class ErrorCode(enum.StrEnum):
    INVALID_REQUEST = "invalid_request"  # the client's fault: bad parameters, bad prompt
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max tokens past the context
    NOT_FOUND = "not_found"  # an unknown model or adapter
    TOO_LARGE = "too_large"  # bigger than the server will ever take
    OVERLOADED = "overloaded"  # full right now: try again later
    UNAVAILABLE = "unavailable"  # a part of the engine is down or restarting
    TIMEOUT = "timeout"  # waited longer than allowed
    INTERNAL = "internal_error"  # our fault


class CallErrorCode(enum.StrEnum):
    """Why a call to an actor failed: the ``code`` of an ``ErrorReply`` and an ``ActorError``."""

    ACTOR_ERROR = "actor_error"  # an ActorError raised without a more precise code
    TIMEOUT = "timeout"  # no reply before the call's deadline
    ACTOR_DIED = "actor_died"  # the callee is down, or died with the call in flight
    UNKNOWN_ACTOR = "unknown_actor"  # no address is known for the callee
    STALE_INCARNATION = "stale_incarnation"  # sent to, or from, an earlier life of an actor
    REJECTED = "rejected"  # an interceptor refused the message (its status says why)
    BAD_MESSAGE = "bad_message"  # the frames did not decode to a valid message
    NO_HANDLER = "no_handler"  # the callee does not accept the message's type
    HANDLER_ERROR = "handler_error"  # the callee's handler raised
    INVALID_REQUEST = "invalid_request"  # the handler refused the caller's parameters
    NOT_FOUND = "not_found"  # the handler does not know what the message names
    LORA_DISABLED = "lora_disabled"  # an adapter call to a server started without LoRA


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
