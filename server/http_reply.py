"""Turns a `Generation` into an HTTP response: one JSON object, or an SSE stream of chunks.

Streams start with the first delta, so an error before any output (engine gone, request
refused) is still an ordinary JSON error with its status. A stream reports its usage only when
`stream_options.include_usage` asks for it, in a last chunk with no choices (as OpenAI does). An
error after the stream started is sent as an `{"error": ...}` event followed by `[DONE]`. A client
that goes away ends the generation (its requests are aborted in the engine by `Generation`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from jaxserve.outputs import Delta
from server.errors import APIError
from server.generation import Generation
from server.openai_bodies import ChatShapes, ChoiceOutput, CompletionShapes
from server.protocol import StreamOptions
from server.sse import EventStream

OnFinish = Callable[[list[ChoiceOutput], Generation], None]


async def respond(
    request: web.Request,
    generation: Generation,
    shapes: ChatShapes | CompletionShapes,
    stream: StreamOptions,
    on_finish: OnFinish | None = None,
) -> web.StreamResponse:
    """Run the generation and answer with it. `on_finish(choices, generation)` runs however it
    ends (finished, failed, cancelled), with whatever the choices hold by then."""
    choices = [ChoiceOutput() for _ in range(generation.num_choices)]
    try:
        if not stream.stream:
            async with aclosing(generation.deltas()) as deltas:
                async for index, delta in deltas:
                    choices[index].add(delta)
            return web.json_response(shapes.response(choices, generation.usage))
        return await _stream(request, generation, shapes, stream.include_usage, choices)
    finally:
        if on_finish is not None:
            on_finish(choices, generation)


async def _stream(
    request: web.Request,
    generation: Generation,
    shapes: ChatShapes | CompletionShapes,
    include_usage: bool,
    choices: list[ChoiceOutput],
) -> web.StreamResponse:
    events = EventStream(request)
    started: set[int] = set()
    try:
        try:
            async with aclosing(generation.deltas()) as deltas:
                async for index, delta in deltas:
                    choices[index].add(delta)
                    if isinstance(shapes, ChatShapes) and index not in started:
                        started.add(index)
                        await events.send(shapes.role_chunk(index, include_usage))
                    if delta.text or delta.finish_reason is not None or delta.logprobs or delta.prompt_logprobs:
                        for chunk in _chunks(shapes, index, delta, include_usage):
                            await events.send(chunk)
            if include_usage:
                if isinstance(shapes, ChatShapes):
                    shapes.count_reasoning(choices, generation.usage)
                await events.send(shapes.usage_chunk(generation.usage))
        except APIError as e:
            if not events.started:
                raise
            await events.send(e.body())
        await events.done()
    except ConnectionError:
        pass  # the client went away; leaving the loop aborted the generation
    return events.response


def _chunks(
    shapes: ChatShapes | CompletionShapes, index: int, delta: Delta, include_usage: bool
) -> list[dict[str, Any]]:
    """A delta's chunks: a chat delta may make several (a call's start, then its arguments), or
    none yet (a call's name still being written)."""
    if isinstance(shapes, ChatShapes):
        return shapes.chunks(index, delta, include_usage)
    return [shapes.chunk(index, delta, include_usage)]
