"""Bytes that do not parse as the call's request message are INVALID_ARGUMENT, not UNKNOWN.

grpc parses a request before the servicer sees it, and answers a parse failure (corrupt wire
format, a string field holding bytes that are not UTF-8) with UNKNOWN and a logged traceback,
as if the server had failed. This interceptor wraps each method's parser so that a failure
becomes a `Malformed` value, which the wrapped method answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclasses.dataclass(frozen=True)
class Malformed:
    reason: str


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_malformed(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Malformed(str(e))

    return parse_or_malformed


def _refusing(method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Callable:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not parse: {request.reason}"
            )
        return await method(request, context)

    return guarded


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.unary_unary is not None:
            return handler._replace(
                request_deserializer=_lenient(handler.request_deserializer), unary_unary=_refusing(handler.unary_unary)
            )
        if handler.unary_stream is not None:
            return handler._replace(
                request_deserializer=_lenient(handler.request_deserializer),
                unary_stream=_refusing(handler.unary_stream),
            )
        return handler
