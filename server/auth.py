"""API keys as Bearer tokens (or in an `x-api-key` header, as Anthropic's clients send them), and
the owner identity that sessions and rate limits hang on.

A key is never stored or logged: the server keys everything on `owner_id(key)`, a short hash,
so a session file on disk does not reveal the key that owns it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from aiohttp import web

from server.errors import APIError

OPEN_OWNER = "anonymous"  # the owner of every request on a server without keys
OWNER_KEY = web.RequestKey("owner", str)  # where the middleware puts the caller's owner id
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


def owner_id(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


def read_key_file(path: str | Path) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    keys = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    if not keys:
        raise ValueError(f"API key file {path} holds no keys")
    return keys


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode() for k in dict.fromkeys(keys)]

    @property
    def is_open(self) -> bool:
        return not self._keys

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> str:
        """The caller's owner id, or APIError 401. The key is `api_key` (an `x-api-key` header)
        when one is given (not blank), else the Bearer token of `authorization`."""
        if self.is_open:
            return OPEN_OWNER
        if api_key is not None and api_key.strip():
            token = api_key.strip()
        elif not authorization:
            raise APIError(
                401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'", code="invalid_api_key"
            )
        else:
            scheme, _, token = authorization.partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                raise APIError(401, "the Authorization header must be 'Bearer <key>'", code="invalid_api_key")
        # aiohttp keeps header bytes that are not UTF-8 as surrogate escapes; they match no key.
        presented = token.encode("utf-8", "surrogateescape")
        # Compare with every key in constant time, so timing reveals neither key nor position.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        if not matched:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return owner_id(token)


def auth_middleware(keys: ApiKeys) -> Callable:
    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        request[OWNER_KEY] = keys.authenticate(request.headers.get("Authorization"), request.headers.get("x-api-key"))
        return await handler(request)

    return middleware
