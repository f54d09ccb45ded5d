"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n` for completions
and chat; `event: <type>\\ndata: <json>\\n\\n` ..., with no `[DONE]`, for the Responses API."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell proxies not to buffer the stream
}


class EventStream:
    """One SSE response. Writes raise `ConnectionResetError` once the client has gone."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.started = False

    async def start(self) -> None:
        await self.response.prepare(self._request)
        self.started = True

    async def send(self, payload: dict[str, Any], event: str | None = None) -> None:
        if not self.started:
            await self.start()
        head = b"" if event is None else b"event: " + event.encode() + b"\n"
        await self.response.write(head + b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

    async def done(self) -> None:
        if not self.started:
            await self.start()
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def close(self) -> None:
        """End the stream without `[DONE]` (the Responses API's last event says it is over)."""
        if not self.started:
            await self.start()
        await self.response.write_eof()
