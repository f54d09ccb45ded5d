"""A Responses API request (`POST /v1/responses`) read into what the server runs: the conversation
as chat messages, function tools and `tool_choice` in chat completions' form, the sampling fields,
`text.format` as structured output, and the request's settings that the response echoes.

`input` is a string (one user message) or a list of items (`server.response_items`), whose input
messages may hold images (collected in the request's `ImageParts`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from server.errors import bad_request
from server.image_parts import ImageParts
from server.response_items import parse_input
from server.response_tools import chat_tool_choice, function_tools
from server.tools import ToolChoice, parse_tool_choice, parse_tools

RESPONSE_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "conversation",
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
    "reasoning": ({}, {"effort": None}, {"effort": None, "summary": None}),
    "max_tool_calls": (),
}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
GUIDED = ("guided_regex", "guided_grammar", "guided_choice", "guided_json")  # with SAMPLING, to build_sampling_params
FORMAT_KEYS = frozenset({"type", "name", "schema", "strict", "description"})
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclasses.dataclass
class ResponseRequest:
    """A checked request: the messages of its input, its items, and its settings."""

    messages: list[dict[str, Any]]  # the input as chat messages (no instructions)
    items: list[dict[str, Any]]  # the input items, with ids
    instructions: str | None
    previous_response_id: str | None
    conversation: str | None  # the id of the conversation it continues and extends
    truncation: bool  # "auto": the oldest input is dropped when it does not fit the context
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


def parse_request(body: dict[str, Any], images: ImageParts) -> ResponseRequest:
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise bad_request(f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    if "input" not in body:
        raise bad_request("input is required", param="input")
    messages, items = parse_input(body["input"], images)
    instructions = _optional(body, "instructions", str)
    previous = _optional(body, "previous_response_id", str)
    conversation = _conversation(body)
    if previous is not None and conversation is not None:
        raise bad_request(
            "previous_response_id and conversation cannot be used together",
            param="conversation",
            code="mutually_exclusive",
        )
    truncation = body.get("truncation", "disabled")
    if truncation not in ("auto", "disabled", None):
        raise bad_request('truncation must be "auto" or "disabled"', param="truncation")
    store, background, stream = _delivery(body)
    tools = parse_tools({"tools": function_tools(body.get("tools", []))})
    choice = parse_tool_choice({"tool_choice": chat_tool_choice(body.get("tool_choice", "auto"))}, tools)
    parallel = _optional(body, "parallel_tool_calls", bool, True)
    text, response_format = _text_format(body.get("text"))
    logprobs = _logprobs(body)
    sampling = {name: body[name] for name in SAMPLING + GUIDED if name in body}
    echo = _echo(body, instructions, previous, store, background, parallel, text, logprobs)
    echo["conversation"] = {"id": conversation} if conversation is not None else None
    echo["truncation"] = truncation or "disabled"
    return ResponseRequest(
        messages,
        items,
        instructions,
        previous,
        conversation,
        truncation == "auto",
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


def _conversation(body: dict[str, Any]) -> str | None:
    """The id of `conversation`: given as the id, or as `{"id": ...}`."""
    value = body.get("conversation")
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if value is not None and not isinstance(value, str):
        raise bad_request('conversation must be a conversation id or {"id": ...}', param="conversation")
    return value


def _delivery(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(store, background, stream): a background response is stored; `stream_options` needs stream."""
    store, background, stream = (
        _optional(body, name, bool, default)
        for name, default in (("store", True), ("background", False), ("stream", False))
    )
    if background and not store:
        raise bad_request("background responses must be stored (store: true)", param="background")
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
        "metadata": parse_metadata(body.get("metadata", {})),
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
        "max_tool_calls": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
    }


def _optional(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise bad_request(f"{name} must be a {kind.__name__}", param=name)
    return value


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


def parse_metadata(value: Any) -> dict[str, str]:
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
