"""Anthropic's Messages API: `POST /v1/messages` (one `message` object, or its SSE event stream with
`stream`) and `POST /v1/messages/count_tokens`.

A request's prompt is what chat completions would make of the same conversation
(`server.messages_request` turns it into chat messages; `server.reply_setup` makes the prompt of
both): the model's chat template, tools shown and tool calls parsed as there (a forced call
enforced with structured output), a final assistant message's text continued, images read as
chat's are (`server.image_parts`). With a reasoning
parser (`--reasoning-parser`) the reply's reasoning is a `thinking` block, and `thinking` sets the
template's `enable_thinking`. Generation, limits and admission are the chat route's. Errors on these
paths have Anthropic's shape (`server.errors`); a key may come as `x-api-key` (`server.auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from contextlib import aclosing
from typing import Any

from aiohttp import web

from server.auth import OWNER_KEY
from server.errors import APIError
from server.generation import EngineRequest, Generation
from server.harmony import is_harmony_template
from server.image_parts import ImageLimits, ImageParts
from server.messages_reply import Event, MessageReply, new_message_id
from server.messages_request import (
    COUNT_TOKENS_FIELDS,
    MESSAGES_FIELDS,
    Conversation,
    parse_conversation,
    parse_messages_request,
)
from server.model_info import ModelInfo
from server.prompts import prompt_ids_or_400
from server.protocol import build_sampling_params, check_fields, max_tokens_setting, read_json_object
from server.reply_setup import chat_prompt_ids, reply_parsing
from server.sse import EventStream
from server.state import STATE, ServerState
from server.tools import ToolCalling, forced_constraint

routes = web.RouteTableDef()

PING_SECONDS = 10.0  # a stream with nothing else to send for this long sends a `ping` event


def encode_conversation(
    info: ModelInfo, conversation: Conversation, images: ImageParts
) -> tuple[list[int], ToolCalling | None]:
    """The prompt's token ids (as chat completions make them, with the loaded `images`, then the
    prefill), and the tool setup its reply is read with (None without tools)."""
    ids, tools = chat_prompt_ids(
        info, conversation.messages, conversation.tools, conversation.choice, conversation.template_kwargs(), images
    )
    if conversation.prefill:
        ids += info.tokenizer.encode(conversation.prefill)
    return ids, tools


def _thinks(state: ServerState) -> bool:
    """Whether replies are read for reasoning (thinking may be enabled): a reasoning parser, or harmony."""
    return state.config.reasoning_parser is not None or is_harmony_template(state.info.template)


@routes.post("/v1/messages")
async def create_message(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    state = request.app[STATE]
    state.limiter.admit(request[OWNER_KEY])
    body = await read_json_object(request)
    check_fields(body, MESSAGES_FIELDS)
    shown, adapter = state.model_for(body)
    images = ImageParts(state.info, ImageLimits.of(state.config))
    req = parse_messages_request(body, _thinks(state), images)
    conversation = req.conversation
    await images.load()
    prompt, tools = encode_conversation(state.info, conversation, images)
    ids = prompt_ids_or_400(prompt, state.info, "messages")
    params = build_sampling_params(
        req.sampling,
        max_tokens=max_tokens_setting({"max_tokens": req.max_tokens}, state.limits, len(ids), None),
        logprobs=None,
        max_n=1,
        vocab_size=state.info.vocab_size,
        guided=forced_constraint(
            conversation.tools, conversation.choice, conversation.parallel, state.config.strict_schemas
        ),
    )
    params = dataclasses.replace(params, lora=adapter)
    parsing, params = reply_parsing(state.info, state.config.reasoning_parser, tools, ids, params)
    reply = MessageReply(new_message_id(), shown.name, parsing, req.stop_sequences, conversation.parallel)
    with state.admission.hold(1):
        engine_request = EngineRequest(reply.id, ids, params, images=images.rows)
        generation = state.generation(request, [engine_request], "messages", arrival)
        if req.stream:
            return await _stream(request, generation, reply)
        async with aclosing(generation.deltas()) as deltas:
            async for _, delta in deltas:
                reply.delta(delta, streaming=False)
        reply.finish(generation.usage)
        return web.json_response(reply.message(generation.usage))


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json_object(request)
    check_fields(body, COUNT_TOKENS_FIELDS)
    state.model_for(body)
    images = ImageParts(state.info, ImageLimits.of(state.config))
    conversation = parse_conversation(body, _thinks(state), images)
    await images.load()
    ids, _ = encode_conversation(state.info, conversation, images)
    return web.json_response({"input_tokens": len(ids)})


class MessageEvents:
    """The SSE stream of one reply: events sent as they come, and a `ping` whenever nothing else
    went out for PING_SECONDS (a long prefill, a tool call held back), so that idle-connection
    timeouts of proxies and clients do not end it."""

    def __init__(self, request: web.Request) -> None:
        self.stream = EventStream(request)
        self._lock = asyncio.Lock()
        self._last = 0.0
        self._pinger: asyncio.Task | None = None

    async def send(self, events: list[Event]) -> None:
        async with self._lock:
            for event in events:
                await self.stream.send(event, event["type"])
            self._last = asyncio.get_running_loop().time()
        if self._pinger is None:
            self._pinger = asyncio.create_task(self._ping())

    async def _ping(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError):
            while True:
                await asyncio.sleep(max(0.0, self._last + PING_SECONDS - loop.time()))
                if loop.time() - self._last >= PING_SECONDS:
                    await self.send([{"type": "ping"}])

    async def close(self) -> None:
        await self.stop_pings()
        await self.stream.close()

    async def stop_pings(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pinger


async def _stream(request: web.Request, generation: Generation, reply: MessageReply) -> web.StreamResponse:
    """Stream the reply's events; an error before the first delta is an ordinary JSON error, one
    after it an `error` event."""
    events = MessageEvents(request)
    try:
        try:
            async with aclosing(generation.deltas()) as deltas:
                async for _, delta in deltas:
                    if not events.stream.started:
                        await events.send(reply.start(generation.usage.prompt_tokens))
                    await events.send(reply.delta(delta))
            await events.send(reply.finish(generation.usage))
        except APIError as e:
            if not events.stream.started:
                raise
            error: dict[str, Any] = e.anthropic_body()
            await events.send([error])
        await events.close()
    except ConnectionError:
        pass  # the client went away; leaving the loop aborted the generation
    finally:
        await events.stop_pings()
    return events.stream.response
