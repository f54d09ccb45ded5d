"""OpenAI's and Anthropic's error shapes, and the middleware that makes every failure one.

Every non-2xx response of the server is `{"error": {"message", "type", "param", "code"}}` with
the status that fits, except on Anthropic's Messages API (`/v1/messages...`, `ANTHROPIC_PATH`),
whose clients read `{"type": "error", "error": {"type", "message"}}` with Anthropic's error types.
Unexpected exceptions are logged with their traceback and answered with a generic 500 that
reveals nothing about the server's internals.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
ANTHROPIC_PATH = "/v1/messages"  # this path and those under it answer errors in Anthropic's shape
_ANTHROPIC_TYPE_BY_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class APIError(Exception):
    """An error answered to the client: status, OpenAI error fields, optional extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def anthropic_type(self) -> str:
        default = "invalid_request_error" if self.status < 500 else "api_error"
        return _ANTHROPIC_TYPE_BY_STATUS.get(self.status, default)

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error object (its `type` from the status; `param` and `code` have no place there)."""
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}

    def response(self, anthropic: bool = False) -> web.Response:
        body = self.anthropic_body() if anthropic else self.body()
        response = web.json_response(body, status=self.status, headers=self.headers)
        if self.headers.get("Connection", "").lower() == "close":
            response.force_close()  # e.g. a stalled body: do not wait for the rest of it
        return response


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, code: str | None = None) -> APIError:
    return APIError(404, message, code=code)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    anthropic = is_anthropic_path(request.path)
    try:
        return await handler(request)
    except APIError as e:
        return e.response(anthropic)
    except ConnectionError:
        raise  # the client went away mid-response: nothing to answer
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own refusals: unknown route (404), wrong method (405), body too large (413).
        message = {
            404: f"unknown path {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: "the request body is too large",
        }.get(e.status, e.reason)
        err = APIError(e.status, message)
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        err.headers.update(headers)
        return err.response(anthropic)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return APIError(500, "the server had an internal error while processing the request").response(anthropic)
