"""`/v1/sessions`: stateful conversations whose history stays in the prefix cache.

    POST   /v1/sessions                       create ({"system", "model", "messages", defaults})
    GET    /v1/sessions                       the caller's sessions
    GET    /v1/sessions/{id}                  one session with its messages
    DELETE /v1/sessions/{id}
    POST   /v1/sessions/{id}/messages         add a user message and generate the reply
    PUT    /v1/sessions/{id}/messages/{k}     edit message k: drop what follows, replace it, and
                                              regenerate the reply when it is a user message
    POST   /v1/sessions/{id}/fork             {"at": k}: a new session with the first k messages
    POST   /v1/sessions/{id}/cancel           stop the reply in flight, keeping its partial text
    POST   /v1/sessions/{id}/continue         generate more of the last assistant message

Replies answer like `/v1/chat/completions` (one JSON object, or SSE chunks with "stream": true)
and take its sampling parameters, on top of the session's defaults. One reply at a time per
session: a second gets 409.

User messages may hold images (chat's `image_url` parts), kept with the session by hash
(`server.session_images`): each turn's prompt places the history's images again, so it is the
prompt of the conversation sent as chat, and its pin keys their blocks by the images' digests.

Every route that changes a session looks the session up only after it has read the body (the
only await before the change), so a session deleted while a slow body was arriving is a 404,
never a late turn in a deleted session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

from aiohttp import web

from jaxserve.image_prompt import cache_token_ids
from jaxserve.sampling_params import SamplingParams
from server.auth import OWNER_KEY
from server.errors import APIError, bad_request, not_found
from server.generation import EngineRequest
from server.http_reply import respond
from server.image_parts import ImageLimits, ImageParts
from server.model_info import ModelInfo
from server.openai_bodies import ChatShapes, ChoiceOutput
from server.prompts import encode_chat, parse_messages, prompt_ids_or_400, render_chat, reply_token_ids
from server.protocol import (
    GUIDED_FIELDS,
    SAMPLING_FIELDS,
    build_sampling_params,
    check_fields,
    logprobs_setting,
    max_tokens_setting,
    parse_stream,
    read_json_object,
    require_str,
)
from server.session_images import attach, has_images, history_urls, kept_urls
from server.sessions import Message, Session
from server.state import STATE, ServerState

routes = web.RouteTableDef()

DEFAULT_FIELDS = (SAMPLING_FIELDS - {"n"}) | {"max_completion_tokens", "logprobs", "top_logprobs"} | GUIDED_FIELDS
CREATE_FIELDS = DEFAULT_FIELDS | {"model", "system", "messages"}
REPLY_FIELDS = DEFAULT_FIELDS | {"model", "stream", "stream_options"}  # model: the session's, if given
MESSAGE_FIELDS = REPLY_FIELDS | {"role", "content"}
CANCEL_WAIT_SECONDS = 30.0


def _images(state: ServerState, param: str) -> ImageParts:
    return ImageParts(state.info, ImageLimits.of(state.config), param=param)


def _session(request: web.Request) -> tuple[ServerState, Session]:
    state = request.app[STATE]
    return state, state.sessions.get(request[OWNER_KEY], request.match_info["session_id"])


def _check_defaults(state: ServerState, defaults: dict[str, Any]) -> None:
    """Refuse bad defaults when the session is created, not at its first reply."""
    max_tokens = max_tokens_setting(defaults, state.limits, 1, None)
    build_sampling_params(
        defaults,
        max_tokens=max_tokens,
        logprobs=logprobs_setting(defaults, chat=True),
        max_n=1,
        vocab_size=state.info.vocab_size,
    )


def _check_length(state: ServerState, messages: list[Message]) -> None:
    limit = state.config.max_session_messages
    if len(messages) > limit:
        raise bad_request(f"a session holds at most {limit} messages", param="messages")


def _session_model(state: ServerState, session: Session, body: dict[str, Any]) -> tuple[ModelInfo, str | None]:
    """The model a session's turn runs: the session's own (a LoRA adapter's KV is its own), named
    again or not in the body (400 for another); 404 when its adapter was unloaded since."""
    named = require_str(body, "model", session.model)
    if named != session.model:
        raise bad_request(
            f"session {session.id} runs model {session.model!r}; it cannot go on with {named!r} "
            "(start another session for it)",
            param="model",
            code="model_mismatch",
        )
    return state.model_for({"model": session.model})


def _claim(session: Session) -> None:
    if session.busy:
        raise APIError(409, "this session is already generating a reply; wait for it or cancel it", code="session_busy")


async def _wait_for_reply(session: Session) -> None:
    try:
        await asyncio.wait_for(session.reply_done.wait(), CANCEL_WAIT_SECONDS)
    except TimeoutError:
        raise APIError(504, "the reply did not stop in time", code="request_timeout") from None


@routes.post("/v1/sessions")
async def create_session(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json_object(request, optional=True)
    check_fields(body, CREATE_FIELDS)
    model = state.model_for(body)[0].name  # the base model or a LoRA adapter, for every turn
    system = require_str(body, "system")
    images = _images(state, "messages")
    messages = parse_messages(body["messages"], images=images) if "messages" in body else []
    urls = attach(messages, images)
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    _check_length(state, messages)
    defaults = {k: v for k, v in body.items() if k in DEFAULT_FIELDS}
    _check_defaults(state, defaults)
    await images.load()  # (checked: a bad image is a 400 now, not at the first turn)
    session = state.sessions.create(request[OWNER_KEY], model, messages, defaults, images=urls)
    return web.json_response(session.public())


@routes.get("/v1/sessions")
async def list_sessions(request: web.Request) -> web.Response:
    state = request.app[STATE]
    sessions = state.sessions.owned_by(request[OWNER_KEY])
    return web.json_response({"object": "list", "data": [s.public() for s in sessions]})


@routes.get("/v1/sessions/{session_id}")
async def get_session(request: web.Request) -> web.Response:
    _, session = _session(request)
    return web.json_response(session.public())


@routes.delete("/v1/sessions/{session_id}")
async def delete_session(request: web.Request) -> web.Response:
    state, session = _session(request)
    if session.reply is not None:
        session.reply.cancel()
        await _wait_for_reply(session)
    state.sessions.remove(session)
    await state.session_kv.end(session)
    return web.json_response({"id": session.id, "object": "session.deleted", "deleted": True})


@routes.post("/v1/sessions/{session_id}/messages")
async def post_message(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    body = await read_json_object(request)
    state, session = _session(request)
    state.limiter.admit(request[OWNER_KEY])
    check_fields(body, MESSAGE_FIELDS)
    role = body.get("role", "user")
    if role != "user":
        raise bad_request("only user messages can be posted; edit a message to change others", param="role")
    if "content" not in body:
        raise bad_request("content is required", param="content")
    images = _images(state, "content")
    message = parse_messages([{"role": "user", "content": body["content"]}], param="content", images=images)[0]
    urls = attach([message], images)
    messages = [*session.messages, message]
    _check_length(state, messages + [{"role": "assistant", "content": ""}])
    return await _reply(request, state, session, body, messages, arrival, False, images, urls)


@routes.put("/v1/sessions/{session_id}/messages/{index}")
async def edit_message(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    body = await read_json_object(request)
    state, session = _session(request)
    try:
        index = int(request.match_info["index"])
    except ValueError:
        raise bad_request("the message index must be an integer") from None
    if not 0 <= index < len(session.messages):
        raise not_found(f"session {session.id} has no message {index}", code="message_not_found")
    check_fields(body, MESSAGE_FIELDS)
    if "content" not in body:
        raise bad_request("content is required", param="content")
    role = body.get("role", session.messages[index]["role"])
    images = _images(state, "content") if role == "user" else None
    message = parse_messages([{"role": role, "content": body["content"]}], param="content", images=images)[0]
    urls = attach([message], images) if images is not None else {}
    messages = [*session.messages[:index], message]
    if message["role"] != "user":
        _claim(session)
        state.sessions.commit(session, messages, images=kept_urls(messages, session.images))
        _pin_text_history(state, session, messages)
        return web.json_response(session.public())
    state.limiter.admit(request[OWNER_KEY])
    return await _reply(request, state, session, body, messages, arrival, False, images, urls)


@routes.post("/v1/sessions/{session_id}/continue")
async def continue_reply(request: web.Request) -> web.StreamResponse:
    arrival = time.perf_counter()
    body = await read_json_object(request, optional=True)
    state, session = _session(request)
    state.limiter.admit(request[OWNER_KEY])
    check_fields(body, REPLY_FIELDS)
    if not session.messages or session.messages[-1]["role"] != "assistant":
        raise bad_request("the last message is not an assistant message; there is nothing to continue")
    messages = [dict(m) for m in session.messages]
    return await _reply(request, state, session, body, messages, arrival, True, _images(state, "messages"), {})


@routes.post("/v1/sessions/{session_id}/fork")
async def fork_session(request: web.Request) -> web.Response:
    body = await read_json_object(request, optional=True)
    state, session = _session(request)
    check_fields(body, frozenset({"at"}))
    at = body.get("at", len(session.messages))
    if not isinstance(at, int) or isinstance(at, bool) or not 0 <= at <= len(session.messages):
        raise bad_request(f"at must be an integer in [0, {len(session.messages)}]", param="at")
    messages = session.messages[:at]
    images = kept_urls(messages, session.images)
    fork = state.sessions.create(session.owner, session.model, messages, session.defaults, images=images)
    _pin_text_history(state, fork, messages)
    return web.json_response(fork.public())


def _pin_text_history(state: ServerState, session: Session, messages: list[Message]) -> None:
    """Pin a history that no reply follows (an edit, a fork). One holding images is not pinned (its
    images are not read here, and its blocks are keyed by their digests); the prefix cache keeps
    its blocks while they are not evicted, and its next turn pins them."""
    if messages and not has_images(messages):
        history = encode_chat(state.info, messages, add_generation_prompt=False)
        state.spawn(state.session_kv.pin_history(session, history))


@routes.post("/v1/sessions/{session_id}/cancel")
async def cancel_reply(request: web.Request) -> web.Response:
    _, session = _session(request)
    if session.reply is None:
        raise APIError(409, "this session has no reply in progress", code="no_reply_in_progress")
    session.reply.cancel()
    await _wait_for_reply(session)
    return web.json_response(session.public())


def _reply_prompt(
    info: ModelInfo, messages: list[Message], continuing: bool, images: ImageParts
) -> tuple[list[int], list[int]]:
    """The reply's prompt ids (the loaded `images` placed in them, as chat places them) and,
    `continuing`, the ids of the open last message it extends."""

    def encode(history: list[Message]) -> list[int]:
        return images.encode(render_chat(info, history)) if images else encode_chat(info, history)

    if not continuing:
        return encode(messages), []
    last = messages[-1]
    open_ids = last.get("token_ids") or (info.tokenizer.encode(last["content"]) if last["content"] else [])
    return encode(messages[:-1]) + open_ids, open_ids


async def _load_images(
    state: ServerState, session: Session, messages: list[Message], images: ImageParts, urls: dict[str, str]
) -> dict[str, str]:
    """Read the turn's images, the history's first (400 when they are more than a request may hold);
    the urls the session keeps with `messages`. 404 when the session was deleted meanwhile, 409 when
    another turn changed it."""
    kept = {**session.images, **urls}
    images.prepend(history_urls(messages[:-1], kept), "messages")
    if not images:
        return kept_urls(messages, kept)
    before = session.messages
    await images.load()
    if not state.sessions.contains(session):
        raise not_found(f"no session {session.id!r}", code="session_not_found")
    if session.messages is not before:
        raise APIError(409, "the session changed while this turn's images were read", code="session_busy")
    return kept_urls(messages, kept)


def _reply_params(state: ServerState, session: Session, body: dict[str, Any], prompt_len: int) -> SamplingParams:
    """The session's default settings, overridden by the request's."""
    settings = {**session.defaults, **{k: v for k, v in body.items() if k in DEFAULT_FIELDS}}
    return build_sampling_params(
        settings,
        max_tokens=max_tokens_setting(settings, state.limits, prompt_len, None),
        logprobs=logprobs_setting(settings, chat=True),
        max_n=1,
        vocab_size=state.info.vocab_size,
    )


async def _reply(
    request: web.Request,
    state: ServerState,
    session: Session,
    body: dict[str, Any],
    messages: list[Message],
    arrival: float,
    continuing: bool,
    images: ImageParts,
    urls: dict[str, str],
) -> web.StreamResponse:
    """Generate the assistant reply to `messages` (or, `continuing`, extend its last message)
    and make `messages` plus the reply the session's history (`urls`: the new message's images)."""
    info = state.info
    shown, adapter = _session_model(state, session, body)
    kept = await _load_images(state, session, messages, images, urls)
    prompt, open_ids = _reply_prompt(info, messages, continuing, images)
    ids = prompt_ids_or_400(prompt, info, param="messages")
    stream = parse_stream(body)
    params = dataclasses.replace(_reply_params(state, session, body, len(ids)), lora=adapter)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    _claim(session)
    with state.admission.hold(1):
        # From here to the reply's end the session is busy; nothing awaits before the claim.
        previous = session.messages
        session.messages = messages  # shown while the reply runs; committed when it ends
        engine_request = EngineRequest(response_id, ids, params, session_id=session.id, images=images.rows)
        generation = state.generation(request, [engine_request], "session", arrival)
        session.reply = generation
        session.reply_done = asyncio.Event()

        def on_finish(choices: list[ChoiceOutput], _: object) -> None:
            choice = choices[0]
            session.reply = None
            session.reply_done.set()
            if generation.outcome in ("error", "timeout") and not choice.token_ids:
                session.messages = previous  # nothing was generated: undo the turn
                return
            content = (messages[-1]["content"] if continuing else "") + choice.text
            reply: Message = {"role": "assistant", "content": content}
            stored = reply_token_ids(info, open_ids, choice.token_ids, content, params.skip_special_tokens)
            if stored is not None:
                reply["token_ids"] = stored
            history = [*messages[:-1], reply] if continuing else [*messages, reply]
            try:
                state.sessions.commit(session, history, images=kept)
            except APIError:
                session.messages = previous  # not saved: the session stays as it is on disk
                return
            state.spawn(state.session_kv.pin_history(session, cache_token_ids(ids + choice.token_ids, images.rows)))

        return await respond(request, generation, ChatShapes(response_id, shown), stream, on_finish)
