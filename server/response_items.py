"""The items of the Responses API's input (and of conversations): read into chat messages.

`input` is a string (one user message) or a list of items: messages (roles user, system,
developer, assistant; text content or `input_text` / `output_text` parts), `function_call` items
(an earlier reply's calls), `function_call_output` items (their results) and `reasoning` items
(an earlier reply's reasoning: kept, not shown to the model). A response's input messages (not
the assistant's) may also hold `input_image` parts (`image_url` a url string, as chat's images:
`server.image_parts`), and so may a conversation's items. Each item is kept, with an id, for
`GET /v1/responses/{id}/input_items` and a conversation's items. Anything else (files, item
references, hosted tools) is a 400 that names it. A response's output items are items of these
types too, so a conversation's items read back the same way.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from server.errors import APIError, bad_request
from server.image_parts import ImageParts

MAX_ADDED_ITEMS = 20  # OpenAI's limit on the items a conversation gets at once
MAX_PAGE = 100
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
TEXT_PARTS = ("input_text", "output_text")
CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
IMAGE_KEYS = frozenset({"type", "image_url", "detail", "file_id"})
IMAGE_DETAILS = ("auto", "low", "high")  # accepted; a Gemma 3 image is always read at one size
REASONING_KEYS = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"})


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def parse_input(value: Any, images: ImageParts | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat messages, items with ids) of `input`; with `images`, the input messages' image parts
    are collected there and shown in their text as the model's image placeholder."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    items = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            items.append(_message_item(item, where, messages, images))
        elif kind == "function_call":
            items.append(_call_item(item, where, messages))
        elif kind == "function_call_output":
            items.append(_output_item(item, where, messages))
        elif kind == "reasoning":
            items.append(_reasoning_item(item, where))
        else:
            raise bad_request(
                f"{where}: items of type {kind!r} are not supported (only messages, function_call, "
                "function_call_output and reasoning)",
                param="input",
            )
    return messages, items


def _check_keys(item: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = set(item) - allowed
    if unknown:
        raise bad_request(f"{where} has unsupported fields: {sorted(unknown)}", param="input")


def _message_item(
    item: dict[str, Any], where: str, messages: list[dict[str, Any]], images: ImageParts | None
) -> dict[str, Any]:
    _check_keys(item, MESSAGE_KEYS, where)
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"{where}.role must be one of {list(MESSAGE_ROLES)}", param="input")
    text, image_parts = _content(item.get("content"), f"{where}.content", images if role != "assistant" else None)
    messages.append({"role": "system" if role == "developer" else role, "content": text})
    part = "output_text" if role == "assistant" else "input_text"
    parts = image_parts or [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}]
    return {"type": "message", "id": _id(item, "msg"), "role": role, "status": "completed", "content": parts}


def _content(content: Any, where: str, images: ImageParts | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The text of a string or a list of text parts; with `images`, also of `input_image` parts
    (collected there, each shown as the model's placeholder), and then, when it holds an image,
    its parts as its item keeps them (else [], and its item keeps one text part)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", param="input")
    texts, parts = [], []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images is not None:
            texts.append(_image(part, at, images))
            parts.append({"type": kind, "image_url": part["image_url"], "detail": part.get("detail", "auto")})
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            _check_keys(part, PART_KEYS, at)
            texts.append(part["text"])
            parts.append({"type": "input_text", "text": part["text"]})
        else:
            what = "only input_text and output_text" if images is None else "input_text, output_text and input_image"
            raise bad_request(f"{at}: {what} parts are supported, not {kind!r}", param="input")
    return "".join(texts), (parts if any(p["type"] == "input_image" for p in parts) else [])


def _image(part: dict[str, Any], where: str, images: ImageParts) -> str:
    """An `input_image` part's placeholder (`ImageParts.add`); file ids are refused (no files here)."""
    images.require_vision(where)
    _check_keys(part, IMAGE_KEYS, where)
    if part.get("file_id") is not None:
        raise bad_request(f"{where}: file_id is not supported (this server keeps no files); send image_url", "input")
    if part.get("detail", "auto") not in IMAGE_DETAILS:
        raise bad_request(f"{where}.detail must be one of {list(IMAGE_DETAILS)}", param="input")
    if not isinstance(part.get("image_url"), str):
        raise bad_request(f"{where}.image_url must be a url string (a data: URL)", param="input")
    return images.add(part["image_url"], where)


def _text_of(content: Any, where: str) -> str:
    return _content(content, where)[0]


def _id(item: dict[str, Any], prefix: str) -> str:
    given = item.get("id")
    if given is not None and not isinstance(given, str):
        raise bad_request("an item's id must be a string", param="input")
    return given or item_id(prefix)


def _call_item(item: dict[str, Any], where: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    _check_keys(item, CALL_KEYS, where)
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise bad_request(f"{where}.{name} must be a string", param="input")
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    if messages and messages[-1]["role"] == "assistant":  # calls of one reply share its message
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return {
        "type": "function_call",
        "id": _id(item, "fc"),
        "call_id": item["call_id"],
        "name": item["name"],
        "arguments": item["arguments"],
        "status": "completed",
    }


def _output_item(item: dict[str, Any], where: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    _check_keys(item, OUTPUT_KEYS, where)
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"{where}.call_id must be a string", param="input")
    output = _text_of(item.get("output"), f"{where}.output")
    messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    return {
        "type": "function_call_output",
        "id": _id(item, "fco"),
        "call_id": item["call_id"],
        "output": output,
        "status": "completed",
    }


def _reasoning_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier reply's reasoning, as clients send it back: kept with the input, not shown to the
    model (chat templates drop the reasoning of earlier turns)."""
    _check_keys(item, REASONING_KEYS, where)
    for name in ("summary", "content"):
        parts = item.get(name, [])
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
        ):
            raise bad_request(f"{where}.{name} must be a list of text parts", param="input")
    return {
        "type": "reasoning",
        "id": _id(item, "rs"),
        "summary": item.get("summary", []),
        **({"content": item["content"]} if "content" in item else {}),
    }


def parse_items(value: Any, param: str, images: ImageParts) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`parse_input` for a list of items sent as `param` (a conversation's), errors naming it."""
    if not isinstance(value, list) or not value or len(value) > MAX_ADDED_ITEMS:
        raise bad_request(f"{param} must be a list of 1 to {MAX_ADDED_ITEMS} items", param=param)
    try:
        return parse_input(value, images)
    except APIError as e:
        where = e.message.removeprefix("input") if e.message.startswith("input") else f": {e.message}"
        raise bad_request(param + where, param=param) from None


def messages_of(items: list[dict[str, Any]], images: ImageParts) -> list[dict[str, Any]]:
    """The chat messages of stored items (a conversation's): what a prompt shows of them, their
    images collected in `images`."""
    return parse_input(items, images)[0] if items else []


def item_page(items: list[dict[str, Any]], query: Mapping[str, str], what: str) -> dict[str, Any]:
    """A page of `items` (oldest first) as OpenAI lists them: `limit` (1-100, 20), `order`
    ("desc" by default), `after` and `before` an item id of `what` (the response, the conversation)."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit must be an integer in [1, {MAX_PAGE}]", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request('order must be "asc" or "desc"', param="order")
    items = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in items]
    start, end = 0, len(items)
    for name in ("after", "before"):
        if name in query:
            if query[name] not in ids:
                raise bad_request(f"{name}: {what} has no item {query[name]!r}", param=name)
            if name == "after":
                start = ids.index(query[name]) + 1
            else:
                end = ids.index(query[name])
    return item_list(items[start:end][:limit], has_more=start + min(limit, end - start) < end)


def item_list(page: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": has_more,
    }
