"""`/v1/responses`: OpenAI's Responses API over the engine, with stored responses kept as sessions.

    POST   /v1/responses                      create: one JSON object, an SSE stream of events
                                              (`stream`), or in the background (`background`: at
                                              once, or with `stream` its events as they come)
    GET    /v1/responses/{id}                 a stored response; with `stream=true` (and
                                              `starting_after`) a background response's events again
    DELETE /v1/responses/{id}
    POST   /v1/responses/{id}/cancel          stop a background response
    GET    /v1/responses/{id}/input_items     its input items (`limit`, `order`, `after`, `before`)

A response's prompt is what chat completions would make of the same conversation: `instructions`
as a system message, the stored conversation of `previous_response_id` or the items of
`conversation` (`server.response_prompt`, which also truncates), then `input`; tools and
`tool_choice` work as there (a forced call is enforced with structured output), and `text.format`
is structured output. Input messages may hold images (`input_image`), read as chat's are. With
`store` (the default) the response is kept (`server.response_store`), so a later one can continue
it: its prompt then starts with exactly the tokens of the stored one (the reply's own token ids),
which the prefix cache (pinned, or on the KV disk tier after a restart) still holds; the images of
its context are kept with it and placed again (`server.response_prompt`). Background responses:
`server.response_background`.
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
from server.errors import APIError, bad_request
from server.generation import EngineRequest, Generation
from server.image_parts import ImageLimits, ImageParts
from server.openai_bodies import ChoiceOutput
from server.prompts import prompt_ids_or_400
from server.protocol import Limits, build_sampling_params, check_fields, guided_setting, read_json_object
from server.reply_setup import reply_parsing
from server.response_background import start_in_background, stream_events
from server.response_events import ResponseEvents
from server.response_items import item_page
from server.response_prompt import context_messages, fitted_prompt, prior_context, within_message_limit
from server.response_request import RESPONSE_FIELDS, ResponseRequest, parse_request
from server.response_shapes import ResponseShapes
from server.response_store import ResponseStore, new_response_id
from server.response_turn import Turn, finish, save
from server.sessions import Session
from server.sse import EventStream
from server.state import STATE, ServerState
from server.tools import forced_constraint

routes = web.RouteTableDef()

CANCEL_WAIT_SECONDS = 30.0


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    state = request.app[STATE]
    owner = request[OWNER_KEY]
    state.limiter.admit(owner)
    body = await read_json_object(request)
    check_fields(body, RESPONSE_FIELDS)
    turn = await _prepare(state, owner, body)
    hold = contextlib.ExitStack()
    hold.enter_context(state.admission.hold(1))
    try:
        engine_request = EngineRequest(
            turn.shapes.id, turn.prompt_ids, turn.params, session_id=turn.chain, images=turn.images
        )
        generation = state.new_generation(owner, [engine_request], "responses", arrival)
        if turn.request.background:
            session = await start_in_background(state, owner, turn, generation, hold.pop_all())
            if turn.request.stream:
                return await stream_events(request, session.events, -1)
            return web.json_response(session.response["object"])
        if turn.request.stream:
            return await _stream(request, state, owner, turn, generation)
        choice = await _collect(generation)
        return web.json_response(await finish(state, owner, turn, choice, generation.usage))
    finally:
        hold.close()


async def _prepare(state: ServerState, owner: str, body: dict[str, Any]) -> Turn:
    shown, adapter = state.model_for(body)
    info = state.info
    images = ImageParts(info, ImageLimits.of(state.config), param="input")
    req = parse_request(body, images)
    context = prior_context(state.responses, owner, req, shown.name, images)
    context = within_message_limit(context, req, state.config.max_session_messages)
    messages = context_messages(req.instructions, context.history, req.messages)
    await images.load()
    ids, tools = fitted_prompt(info, messages, req, _output_room(body), images)
    ids = prompt_ids_or_400(ids, info, "input")
    params = build_sampling_params(
        req.sampling,
        max_tokens=_max_output_tokens(body, state.limits, len(ids)),
        logprobs=req.logprobs,
        max_n=1,
        vocab_size=info.vocab_size,
        guided=_constraint(req, state.config.strict_schemas),
    )
    params = dataclasses.replace(params, lora=adapter)
    response_id = new_response_id()
    parsing, params = reply_parsing(info, state.config.reasoning_parser, tools, ids, params)
    shapes = ResponseShapes(response_id, shown, req.echo, parsing)
    chain = next((s.placement_id for s in (context.previous, context.conversation) if s is not None), response_id)
    return Turn(req, shapes, context, chain, ids, params, images.rows, tuple(images.urls))


def _output_room(body: dict[str, Any]) -> int:
    """The output tokens a prompt must leave room for: `max_output_tokens` (checked later), at least one."""
    value = body.get("max_output_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _constraint(req: ResponseRequest, strict: bool) -> Any:
    """The structured output of a forced tool call (the reply is a call, whatever `text.format`
    says of text), else of `text.format` (which leaves no room for a call: with tool_choice auto, a
    reply is then text)."""
    given = None
    if req.response_format is not None:
        try:
            given = guided_setting({"response_format": req.response_format}, strict)
        except APIError as e:
            raise bad_request(
                f"text.format: {e.message.removeprefix('response_format: ')}", param="text", code=e.code
            ) from None
    return forced_constraint(req.tools, req.tool_choice, req.parallel_tool_calls, strict) or given


def _max_output_tokens(body: dict[str, Any], limits: Limits, prompt_tokens: int) -> int:
    value = body.get("max_output_tokens")
    room = limits.max_model_len - prompt_tokens
    if value is None:
        return max(1, min(limits.max_tokens_limit, room))
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limits.max_tokens_limit:
        raise bad_request(
            f"max_output_tokens must be an integer in [1, {limits.max_tokens_limit}]", param="max_output_tokens"
        )
    if value > room:
        raise bad_request(
            f"this model's maximum context length is {limits.max_model_len} tokens; the response asks "
            f"for {prompt_tokens + value} ({prompt_tokens} of input, {value} to generate)",
            param="max_output_tokens",
            code="context_length_exceeded",
        )
    return value


async def _collect(generation: Generation) -> ChoiceOutput:
    choice = ChoiceOutput()
    async with aclosing(generation.deltas()) as deltas:
        async for _, delta in deltas:
            choice.add(delta)
    return choice


async def _stream(
    request: web.Request, state: ServerState, owner: str, turn: Turn, generation: Generation
) -> web.StreamResponse:
    """Stream the response's events; an error before the first delta is an ordinary JSON error."""
    stream = EventStream(request)
    events = ResponseEvents(turn.shapes)
    choice = ChoiceOutput()

    async def send(batch: list[dict[str, Any]]) -> None:
        for event in batch:
            await stream.send(event, event["type"])

    try:
        try:
            async with aclosing(generation.deltas()) as deltas:
                async for _, delta in deltas:
                    if not stream.started:
                        await send(events.start())
                    choice.add(delta)
                    await send(events.delta(delta))
            finished, body = events.finish(choice, generation.usage)
            await save(state, owner, turn, choice, body)  # before the client hears it is done
            await send(finished)
        except APIError as e:
            if not stream.started:
                raise
            await send([events.failed(e.code or e.type, e.message)])
        await stream.close()
    except ConnectionError:
        pass  # the client went away; leaving the loop aborted the generation
    return stream.response


def _response(request: web.Request) -> tuple[ServerState, Session]:
    state = request.app[STATE]
    return state, state.responses.get(request[OWNER_KEY], request.match_info["response_id"])


@routes.get("/v1/responses/{response_id}")
async def get_response(request: web.Request) -> web.StreamResponse:
    """The stored response, or with `stream=true` a background response's events (after
    `starting_after`: a sequence number)."""
    _, session = _response(request)
    if request.query.get("stream", "false") == "false":
        return web.json_response(ResponseStore.public(session))
    if request.query["stream"] != "true":
        raise bad_request("stream must be true or false", param="stream")
    if session.events is None:
        raise bad_request(
            "only a background response can be streamed again, while this server holds its events",
            param="stream",
            code="unsupported_parameter",
        )
    try:
        after = int(request.query.get("starting_after", "-1"))
    except ValueError:
        after = -2
    if after < -1:
        raise bad_request("starting_after must be a sequence number (an integer >= 0)", param="starting_after")
    return await stream_events(request, session.events, after)


@routes.delete("/v1/responses/{response_id}")
async def delete_response(request: web.Request) -> web.Response:
    state, session = _response(request)
    await _stop(session)
    await state.responses.remove(session)
    return web.json_response({"id": session.id, "object": "response", "deleted": True})


@routes.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: web.Request) -> web.Response:
    _, session = _response(request)
    if not session.response["object"].get("background"):
        raise bad_request("only background responses can be cancelled", code="not_background")
    await _stop(session)
    return web.json_response(ResponseStore.public(session))


async def _stop(session: Session) -> None:
    """Cancel the response's generation in flight (a background one) and wait for it to end."""
    if session.reply is None:
        return
    session.reply.cancel()
    try:
        await asyncio.wait_for(session.reply_done.wait(), CANCEL_WAIT_SECONDS)
    except TimeoutError:
        raise APIError(504, "the response did not stop in time", code="request_timeout") from None


@routes.get("/v1/responses/{response_id}/input_items")
async def input_items(request: web.Request) -> web.Response:
    _, session = _response(request)
    return web.json_response(item_page(session.response["input_items"], request.query, "the response"))
