"""`/v1/conversations`: OpenAI's Conversations API, the stored context of Responses API turns.

    POST   /v1/conversations                          create (optional `items`, `metadata`)
    GET    /v1/conversations/{id}                     the conversation
    POST   /v1/conversations/{id}                     update its `metadata`
    DELETE /v1/conversations/{id}
    GET    /v1/conversations/{id}/items               its items (`limit`, `order`, `after`, `before`)
    POST   /v1/conversations/{id}/items               add `items` (1 to 20)
    GET    /v1/conversations/{id}/items/{item_id}     one item
    DELETE /v1/conversations/{id}/items/{item_id}     remove it (the conversation comes back)

A response created with `conversation` reads its items as the context before its input, and its
input and output items are added to it when it ends (`server.routes_responses`). Its items may
hold images (`input_image` parts, checked as a response's input images are), which a response
made in it places in its prompt (`server.response_prompt`). Conversations
are stored as responses are (`server.response_store`): per key, written before they change when
there is a `--session-dir`, expiring after `--response-ttl` idle.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from server.auth import OWNER_KEY
from server.errors import APIError, bad_request
from server.image_parts import ImageLimits, ImageParts
from server.protocol import check_fields, read_json_object
from server.response_items import item_list, item_page, parse_items
from server.response_request import parse_metadata
from server.sessions import Session
from server.state import STATE, ServerState

routes = web.RouteTableDef()

CONVERSATION_FIELDS = frozenset({"items", "metadata"})
METADATA_FIELDS = frozenset({"metadata"})
ITEMS_FIELDS = frozenset({"items"})


def _conversation(request: web.Request) -> tuple[ServerState, Session]:
    state = request.app[STATE]
    return state, state.responses.conversation(request[OWNER_KEY], request.match_info["conversation_id"])


async def _parsed_items(state: ServerState, value: Any) -> list[dict[str, Any]]:
    """The items sent as `items`, their images (for a model that takes them) read to check them."""
    images = ImageParts(state.info, ImageLimits.of(state.config), param="items")
    _, items = parse_items(value, "items", images)
    await images.load()
    return items


def _item(session: Session, request: web.Request) -> tuple[int, dict[str, Any]]:
    """(index, item) of the item the path names, or 404."""
    wanted = request.match_info["item_id"]
    for index, item in enumerate(session.response["items"]):
        if item["id"] == wanted:
            return index, item
    raise APIError(404, f"the conversation has no item {wanted!r}", code="item_not_found")


@routes.post("/v1/conversations")
async def create_conversation(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json_object(request)
    check_fields(body, CONVERSATION_FIELDS)
    items = await _parsed_items(state, body["items"]) if body.get("items") not in (None, []) else []
    metadata = parse_metadata(body.get("metadata") or {})
    session = await state.responses.create_conversation(request[OWNER_KEY], state.info.name, items, metadata)
    return web.json_response(session.response["object"])


@routes.get("/v1/conversations/{conversation_id}")
async def get_conversation(request: web.Request) -> web.Response:
    _, session = _conversation(request)
    return web.json_response(session.response["object"])


@routes.post("/v1/conversations/{conversation_id}")
async def update_conversation(request: web.Request) -> web.Response:
    state, session = _conversation(request)
    body = await read_json_object(request)
    check_fields(body, METADATA_FIELDS)
    if "metadata" not in body:
        raise bad_request("metadata is required", param="metadata")
    state.responses.change_conversation(session, metadata=parse_metadata(body["metadata"] or {}))
    return web.json_response(session.response["object"])


@routes.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(request: web.Request) -> web.Response:
    state, session = _conversation(request)
    await state.responses.remove(session)
    return web.json_response({"id": session.id, "object": "conversation.deleted", "deleted": True})


@routes.get("/v1/conversations/{conversation_id}/items")
async def list_items(request: web.Request) -> web.Response:
    _, session = _conversation(request)
    return web.json_response(item_page(session.response["items"], request.query, "the conversation"))


@routes.post("/v1/conversations/{conversation_id}/items")
async def add_items(request: web.Request) -> web.Response:
    state, session = _conversation(request)
    body = await read_json_object(request)
    check_fields(body, ITEMS_FIELDS)
    if "items" not in body:
        raise bad_request("items is required", param="items")
    added = await _parsed_items(state, body["items"])
    taken = {item["id"] for item in session.response["items"]}
    if any(item["id"] in taken for item in added) or len({item["id"] for item in added}) < len(added):
        raise bad_request("items: an item's id is already in the conversation", param="items")
    state.responses.change_conversation(session, items=[*session.response["items"], *added])
    return web.json_response(item_list(added))


@routes.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(request: web.Request) -> web.Response:
    _, session = _conversation(request)
    return web.json_response(_item(session, request)[1])


@routes.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(request: web.Request) -> web.Response:
    state, session = _conversation(request)
    index, _ = _item(session, request)
    items = session.response["items"]
    state.responses.change_conversation(session, items=items[:index] + items[index + 1 :])
    return web.json_response(session.response["object"])
