"""`/v1/completions`, `/v1/chat/completions` and `/v1/models`."""

from __future__ import annotations

import dataclasses
import time
import uuid

from aiohttp import web

from server.auth import OWNER_KEY
from server.errors import bad_request, not_found
from server.generation import EngineRequest
from server.http_reply import respond
from server.image_parts import ImageLimits, ImageParts
from server.model_info import ModelInfo
from server.openai_bodies import ChatShapes, CompletionShapes
from server.prompts import completion_prompts, parse_messages, prompt_ids_or_400
from server.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    build_sampling_params,
    check_best_of,
    check_fields,
    echo_setting,
    logprobs_setting,
    max_tokens_setting,
    parse_stream,
    read_json_object,
    require_bool,
)
from server.reply_setup import chat_prompt_ids, reply_parsing, template_kwargs_setting
from server.state import STATE, ServerState
from server.tools import forced_constraint, parse_tool_choice, parse_tools

routes = web.RouteTableDef()


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    state = request.app[STATE]
    state.limiter.admit(request[OWNER_KEY])
    body = await read_json_object(request)
    check_fields(body, COMPLETION_FIELDS)
    check_best_of(body)
    info, adapter = state.model_for(body)
    stream = parse_stream(body)
    prompts = completion_prompts(body, state.info, state.config.max_prompts)
    longest = max(len(ids) for _, ids in prompts)
    max_tokens = max_tokens_setting(body, state.limits, longest, DEFAULT_COMPLETION_MAX_TOKENS)
    logprobs = logprobs_setting(body, chat=False)
    echo = echo_setting(body)
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        max_n=state.limits.max_n,
        vocab_size=state.info.vocab_size,
        echo=echo,
        strict_schemas=state.config.strict_schemas,
    )
    params = dataclasses.replace(params, lora=adapter)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    requests = [
        EngineRequest(response_id if len(prompts) == 1 else f"{response_id}-{i}", ids, params, i * params.n)
        for i, (_, ids) in enumerate(prompts)
    ]
    shapes = CompletionShapes(
        response_id, info, prompts if echo else None, params.n, show_prompt_logprobs="prompt_logprobs" in body
    )
    with state.admission.hold(params.n * len(prompts)):
        generation = state.generation(request, requests, "completions", arrival)
        return await respond(request, generation, shapes, stream)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    state = request.app[STATE]
    state.limiter.admit(request[OWNER_KEY])
    body = await read_json_object(request)
    check_fields(body, CHAT_FIELDS)
    info, adapter = state.model_for(body)
    stream = parse_stream(body)
    if "messages" not in body:
        raise bad_request("messages is required", param="messages")
    images = ImageParts(state.info, ImageLimits.of(state.config))
    messages = parse_messages(body["messages"], tools=True, images=images)
    tools = parse_tools(body)
    choice = parse_tool_choice(body, tools)
    await images.load()
    ids, calling = chat_prompt_ids(state.info, messages, tools, choice, template_kwargs_setting(body), images)
    ids = prompt_ids_or_400(ids, state.info, "messages")
    max_tokens = max_tokens_setting(body, state.limits, len(ids), None)
    strict = state.config.strict_schemas
    forced = forced_constraint(tools, choice, require_bool(body, "parallel_tool_calls", True), strict)
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs_setting(body, chat=True),
        max_n=state.limits.max_n,
        vocab_size=state.info.vocab_size,
        guided=forced,
        strict_schemas=strict,
    )
    params = dataclasses.replace(params, lora=adapter)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    parsing, params = reply_parsing(state.info, state.config.reasoning_parser, calling, ids, params)
    shapes = ChatShapes(response_id, info, parsing, show_prompt_logprobs="prompt_logprobs" in body)
    with state.admission.hold(params.n):
        engine_request = EngineRequest(response_id, ids, params, images=images.rows)
        generation = state.generation(request, [engine_request], "chat", arrival)
        return await respond(request, generation, shapes, stream)


def _model_card(info: ModelInfo) -> dict[str, object]:
    return {
        "id": info.name,
        "object": "model",
        "created": info.created,
        "owned_by": "jaxserve",
        "max_model_len": info.max_model_len,
        # What it serves: "generate" (and embeddings of its hidden states) or "embed" (an encoder).
        "task": "generate" if info.encoder is None else "embed",
    }


def _cards(state: ServerState) -> dict[str, dict[str, object]]:
    """Every model served by name: the base model, then its LoRA adapters, whose cards name their
    base model (`parent`) and directory (`root`), as vLLM's do."""
    base = _model_card(state.info)
    cards = {state.info.name: base}
    cards.update(
        {name: {**base, "id": name, "root": path, "parent": state.info.name} for name, path in state.adapters.items()}
    )
    return cards


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": list(_cards(request.app[STATE]).values())})


@routes.get("/v1/models/{model}")
async def model(request: web.Request) -> web.Response:
    card = _cards(request.app[STATE]).get(request.match_info["model"])
    if card is None:
        raise not_found(f"the model {request.match_info['model']!r} does not exist", code="model_not_found")
    return web.json_response(card)
