"""A Responses API request (`POST /v1/responses`) read into what the server runs: the conversation
as chat messages, function tools and `tool_choice` in chat completions' form, the sampling fields,
`text.format` as structured output, and the request's settings that the response echoes.

`input` is a string (one user message) or a list of items: messages (roles user, system,
developer, assistant; text content or `input_text` / `output_text` parts), `function_call` items
(an earlier reply's calls), `function_call_output` items (their results) and `reasoning` items
(an earlier reply's reasoning: kept, not shown to the model). Each item is kept, with an id, for
`GET /v1/responses/{id}/input_items`. Anything else (images, files, item references, hosted
tools) is a 400 that names it.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from server.errors import bad_request
from server.response_tools import chat_tool_choice, function_tools
from server.tools import ToolChoice, parse_tool_choice, parse_tools

RESPONSE_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "store",
        "background",
        "stream",
        "stream_options",
        "max_output_tokens",
        "temperature",
        "top_p",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "include",
        "metadata",
        "user",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "truncation",
        "reasoning",
        "max_tool_calls",
        # vLLM's extra sampling fields
        "top_k",
        "min_p",
        "repetition_penalty",
        "seed",
        # vLLM's structured-output extras
        "guided_regex",
        "guided_grammar",
        "guided_choice",
        "guided_json",
    }
)
# Fields the server does not implement, with the values that mean "not used".
NEUTRAL = {
    "truncation": ("disabled",),
    "reasoning": ({}, {"effort": None}, {"effort": None, "summary": None}),
    "max_tool_calls": (),
}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
GUIDED = ("guided_regex", "guided_grammar", "guided_choice", "guided_json")  # with SAMPLING, to build_sampling_params
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
TEXT_PARTS = ("input_text", "output_text")
CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
REASONING_KEYS = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"})
FORMAT_KEYS = frozenset({"type", "name", "schema", "strict", "description"})
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclasses.dataclass
class ResponseRequest:
    """A checked request: the messages of its input, its items, and its settings."""

    messages: list[dict[str, Any]]  # the input as chat messages (no instructions)
    items: list[dict[str, Any]]  # the input items, with ids
    instructions: str | None
    previous_response_id: str | None
    store: bool
    background: bool
    stream: bool
    tools: list[dict[str, Any]]  # chat completions' form
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    sampling: dict[str, Any]  # sampling fields, with chat completions' names
    response_format: dict[str, Any] | None  # `text.format` as chat completions' response_format
    logprobs: int | None  # top log-probabilities per output token, None for none
    echo: dict[str, Any]  # what the response shows of the request (tools, text, sampling, metadata, ...)


def parse_request(body: dict[str, Any]) -> ResponseRequest:
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise bad_request(f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    if "input" not in body:
        raise bad_request("input is required", param="input")
    messages, items = parse_input(body["input"])
    instructions = _optional(body, "instructions", str)
    previous = _optional(body, "previous_response_id", str)
    store, background, stream = _delivery(body)
    tools = parse_tools({"tools": function_tools(body.get("tools", []))})
    choice = parse_tool_choice({"tool_choice": chat_tool_choice(body.get("tool_choice", "auto"))}, tools)
    parallel = _optional(body, "parallel_tool_calls", bool, True)
    text, response_format = _text_format(body.get("text"))
    logprobs = _logprobs(body)
    sampling = {name: body[name] for name in SAMPLING + GUIDED if name in body}
    echo = _echo(body, instructions, previous, store, background, parallel, text, logprobs)
    return ResponseRequest(
        messages,
        items,
        instructions,
        previous,
        store,
        background,
        stream,
        tools,
        choice,
        parallel,
        sampling,
        response_format,
        logprobs,
        echo,
    )


def _delivery(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(store, background, stream): a background response is stored and not streamed; `stream_options` needs stream."""
    store, background, stream = (
        _optional(body, name, bool, default)
        for name, default in (("store", True), ("background", False), ("stream", False))
    )
    if background and not store:
        raise bad_request("background responses must be stored (store: true)", param="background")
    if background and stream:
        raise bad_request(
            "a background response cannot be streamed; retrieve it instead",
            param="stream",
            code="unsupported_parameter",
        )
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_obfuscation"}):
        raise bad_request(
            "stream_options is only allowed with stream, and only include_obfuscation", param="stream_options"
        )
    return store, background, stream


def _echo(
    body: dict[str, Any],
    instructions: str | None,
    previous: str | None,
    store: bool,
    background: bool,
    parallel: bool,
    text: dict[str, Any],
    logprobs: int | None,
) -> dict[str, Any]:
    """What the response shows of the request: its checked settings, the rest with their defaults."""
    return {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": _metadata(body.get("metadata", {})),
        "parallel_tool_calls": parallel,
        "previous_response_id": previous,
        "store": store,
        "background": background,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "text": text,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "top_logprobs": logprobs or 0,
        "user": body.get("user"),
        "truncation": "disabled",
        "max_tool_calls": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
    }


def _optional(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise bad_request(f"{name} must be a {kind.__name__}", param=name)
    return value


def parse_input(value: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(chat messages, items with ids) of `input`."""
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
            items.append(_message_item(item, where, messages))
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


def _message_item(item: dict[str, Any], where: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    _check_keys(item, MESSAGE_KEYS, where)
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"{where}.role must be one of {list(MESSAGE_ROLES)}", param="input")
    text = _text_of(item.get("content"), f"{where}.content")
    messages.append({"role": "system" if role == "developer" else role, "content": text})
    part = "output_text" if role == "assistant" else "input_text"
    return {
        "type": "message",
        "id": _id(item, "msg"),
        "role": role,
        "status": "completed",
        "content": [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}],
    }


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad_request(
                f"{where}[{j}]: only input_text and output_text parts are supported, not {kind!r}", param="input"
            )
        _check_keys(part, PART_KEYS, f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


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


def _text_format(text: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the `text` setting as the response shows it, chat completions' response_format or None)."""
    if text is None:
        return {"format": {"type": "text"}, "verbosity": "medium"}, None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("text must be an object with format (and verbosity)", param="text")
    if text.get("verbosity", "medium") != "medium":
        raise bad_request("text.verbosity is not supported by this server", param="text", code="unsupported_parameter")
    fmt = text.get("format", {"type": "text"})
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    shown = {"format": fmt, "verbosity": "medium"}
    if kind == "text" and set(fmt) == {"type"}:
        return shown, None
    if kind == "json_object" and set(fmt) == {"type"}:
        return shown, {"type": "json_object"}
    if kind == "json_schema" and not set(fmt) - FORMAT_KEYS and isinstance(fmt.get("schema"), dict):
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return shown, {"type": "json_schema", "json_schema": spec}
    raise bad_request(
        'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"name": ..., "schema": {...}}',
        param="text",
    )


def _logprobs(body: dict[str, Any]) -> int | None:
    """Top log-probabilities per output token: `top_logprobs`, with the include that asks for them."""
    include = body.get("include", [])
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad_request("include must be a list of strings", param="include")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise bad_request("top_logprobs must be an integer in [0, 20]", param="top_logprobs")
    return (top or 0) if LOGPROBS_INCLUDE in include or top else None


def _metadata(value: Any) -> dict[str, str]:
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA
        or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()
        )
    ):
        raise bad_request(
            f"metadata must map at most {MAX_METADATA} keys (64 characters) to strings (512 characters)",
            param="metadata",
        )
    return value
