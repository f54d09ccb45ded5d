"""Streaming OpenAI-style requests over aiohttp, timed on the client.

Each call sends one streamed request and returns a `RequestRecord`: the send time, the arrival
time of every SSE chunk that carried output text, the end of the stream, and the token counts
(from the final `usage` chunk when the server sends one; else `max_tokens` when the stream
finished for `length`, else one token per output chunk).
Errors are recorded on the record, never raised, so one bad request does not stop a run.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from bench.metrics import RequestRecord


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where and how to send: the server's base URL and what the server needs added to each body."""

    base_url: str  # http://127.0.0.1:8000
    model: str  # the `model` field of each request
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. {"ignore_eos": True}
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


_EVENT_END = re.compile(rb"\r?\n\r?\n")  # a blank line ends an SSE event (sse-starlette sends CRLF)


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """(arrival time, parsed JSON) for each `data:` event until `[DONE]` or the end of the body."""
    buffer = b""
    async for raw in response.content.iter_any():
        now = time.perf_counter()
        buffer += raw
        while (end := _EVENT_END.search(buffer)) is not None:
            event, buffer = buffer[: end.start()], buffer[end.end() :]
            for line in event.decode("utf-8").splitlines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                yield now, json.loads(payload)


def _chunk_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], endpoint: Endpoint,
                  prompt_tokens: int, group: str) -> RequestRecord:  # fmt: skip
    record = RequestRecord(start=time.perf_counter(), end=0.0, chunk_times=[], output_tokens=0,
                           prompt_tokens=prompt_tokens, group=group)  # fmt: skip
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    text: list[str] = []
    try:
        async with session.post(url, json={**body, **endpoint.extra_body}, headers=endpoint.headers) as response:
            if response.status != 200:
                record.success = False
                record.error = f"HTTP {response.status}: {(await response.text())[:500]}"
            else:
                async for arrived, event in _sse_events(response):
                    if "error" in event:
                        raise RuntimeError(f"server error in stream: {event['error']}")
                    piece = _chunk_text(event)
                    if piece:
                        record.chunk_times.append(arrived)
                        text.append(piece)
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or []:
                        finish_reason = choice.get("finish_reason") or finish_reason
    except (aiohttp.ClientError, RuntimeError, ValueError, TimeoutError) as e:
        record.success = False
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.perf_counter()
    record.output_text = "".join(text)
    if usage is not None:
        record.output_tokens = int(usage.get("completion_tokens", len(record.chunk_times)))
        record.prompt_tokens = int(usage.get("prompt_tokens", prompt_tokens))
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])
    elif finish_reason == "length":  # no usage (llama-cpp-python's server): it stopped at max_tokens
        record.output_tokens = body["max_tokens"]
    else:
        record.output_tokens = len(record.chunk_times)
    if record.success and not record.chunk_times:
        record.success = False
        record.error = "the stream carried no output"
    return record


def _sampling(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


async def completion(session: aiohttp.ClientSession, endpoint: Endpoint, prompt: str | list[int], max_tokens: int,
                     prompt_tokens: int, group: str = "") -> RequestRecord:  # fmt: skip
    body = {"model": endpoint.model, "prompt": prompt, **_sampling(max_tokens)}
    return await _stream(session, f"{endpoint.base_url}/v1/completions", body, endpoint, prompt_tokens, group)


async def chat(session: aiohttp.ClientSession, endpoint: Endpoint, messages: list[dict[str, Any]], max_tokens: int,
               prompt_tokens: int, group: str = "") -> RequestRecord:  # fmt: skip
    body = {"model": endpoint.model, "messages": messages, **_sampling(max_tokens)}
    return await _stream(session, f"{endpoint.base_url}/v1/chat/completions", body, endpoint, prompt_tokens, group)


async def create_session(session: aiohttp.ClientSession, endpoint: Endpoint, system: str | None) -> str:
    body: dict[str, Any] = {"model": endpoint.model}
    if system:
        body["system"] = system
    async with session.post(f"{endpoint.base_url}/v1/sessions", json=body, headers=endpoint.headers) as response:
        if response.status != 200:
            raise RuntimeError(f"creating a session: HTTP {response.status}: {(await response.text())[:500]}")
        return (await response.json())["id"]


async def session_turn(session: aiohttp.ClientSession, endpoint: Endpoint, session_id: str, content: str,
                       max_tokens: int, prompt_tokens: int, group: str = "") -> RequestRecord:  # fmt: skip
    """Append a user message to a server-side session and stream the reply."""
    body = {"role": "user", "content": content, **_sampling(max_tokens)}
    url = f"{endpoint.base_url}/v1/sessions/{session_id}/messages"
    return await _stream(session, url, body, endpoint, prompt_tokens, group)


async def delete_session(session: aiohttp.ClientSession, endpoint: Endpoint, session_id: str) -> None:
    async with session.delete(f"{endpoint.base_url}/v1/sessions/{session_id}", headers=endpoint.headers):
        pass
