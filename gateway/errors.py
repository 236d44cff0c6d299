"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway reports, from bad JSON to a dead actor, leaves through
:class:`ApiError` so clients (the ``openai`` package in particular) can read the
status, the message and a stable code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..messages.errors import CallErrorCode

if TYPE_CHECKING:
    from ..actors.runtime import ActorError

__all__ = ["ApiError", "error_payload", "error_response", "error_type", "from_actor_error"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class ApiError(Exception):
    """An error answer: raise it anywhere below a handler; the error middleware renders it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or error_type(status)
        self.param = param
        self.headers = headers or {}
        self.close = close  # the connection ends with this answer

    def payload(self) -> dict[str, Any]:
        return error_payload(self.status, self.message, self.code, self.param)


def from_actor_error(exc: ActorError) -> ApiError:
    """An actor's refusal as an answer with its 4xx/5xx status."""
    status = exc.status if 400 <= exc.status < 600 else 500
    # A handler's crash is no code a client can act on: the status's own name stands.
    code = exc.code if exc.code is not CallErrorCode.HANDLER_ERROR else None
    headers = {"Retry-After": "2"} if status == 503 else None
    return ApiError(status, str(exc), code=code, headers=headers)


def error_payload(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": code or error_type(status),
        }
    }


def error_response(err: ApiError) -> web.Response:
    response = web.json_response(err.payload(), status=err.status, headers=err.headers)
    if err.close:
        response.force_close()
    return response
