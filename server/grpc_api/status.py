"""`APIError` (the HTTP API's errors) -> gRPC status codes, details and trailing metadata."""

from __future__ import annotations

from typing import NoReturn

import grpc

from server.errors import APIError

_CODE_BY_HTTP_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# HTTP answers a full waiting queue with 503 (as vLLM does); in gRPC a refusal for load that the
# client should retry later is RESOURCE_EXHAUSTED, and UNAVAILABLE means the engine is down.
_CODE_BY_ERROR_CODE = {"server_overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED}


def status_code(error: APIError) -> grpc.StatusCode:
    by_code = _CODE_BY_ERROR_CODE.get(error.code or "")
    return by_code or _CODE_BY_HTTP_STATUS.get(error.status, grpc.StatusCode.INTERNAL)


def trailing_metadata(error: APIError) -> tuple[tuple[str, str], ...]:
    """The error's code and param, and its HTTP headers (Retry-After) as lower-case metadata."""
    items = [("error-code", error.code), ("error-param", error.param)]
    items += [(name.lower(), value) for name, value in error.headers.items()]
    return tuple((name, value) for name, value in items if value)


async def abort(context: grpc.aio.ServicerContext, error: APIError) -> NoReturn:
    """End the call with the error's status (raises, as `context.abort` does)."""
    await context.abort(status_code(error), error.message, trailing_metadata(error))
