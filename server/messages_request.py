"""Anthropic Messages API request bodies, checked and turned into what the other routes already run:
the conversation as chat messages (the shape `server.prompts` and `server.tools` render, tool calls
and results included), tools and `tool_choice` in chat completions' form, and the sampling fields.

Anthropic's rules where they matter to a client: `max_tokens` is required; `system` is a top-level
string or list of text blocks, never a message; messages are `user` or `assistant`, the first a
user message, each with non-empty content except a final assistant message, whose text the reply
continues (a "prefill": no trailing whitespace); a `tool_result` answers a `tool_use` of the
assistant message just before it; tool_use ids are unique. Content blocks are text, tool_use
(assistant), tool_result and image (user; an image also inside a tool_result's content). An image's
source is base64 data (`media_type` image/jpeg, png, gif or webp) or a url, read as chat's image
urls are (`server.image_parts`: data: URLs, files under `--allowed-local-media-path`, never the
network); a model without a vision tower refuses it. Document blocks are refused.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from server.errors import APIError, bad_request
from server.image_parts import ImageParts
from server.messages_images import IMAGE_KEYS, image_block_text
from server.tools import ToolChoice, parse_tool_choice, parse_tools

MESSAGES_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "service_tier",
    }
)
COUNT_TOKENS_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})
TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})
TOOL_USE_KEYS = frozenset({"type", "id", "name", "input", "cache_control"})
TOOL_RESULT_KEYS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"})
BLOCKS_BY_ROLE = {
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}
# An earlier reply's thinking, as clients send it back: accepted, not shown to the model (chat
# templates drop the reasoning of earlier turns).
THINKING_KEYS = {
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclasses.dataclass(frozen=True)
class Conversation:
    """What a prompt is made of: chat messages (system first), the text a final assistant message
    gives the reply to continue, and the tools with the choice among them."""

    messages: list[dict[str, Any]]
    prefill: str
    tools: list[dict[str, Any]]
    choice: ToolChoice
    parallel: bool  # more than one tool call per reply (not `disable_parallel_tool_use`)
    thinking: bool | None = None  # `thinking` enabled or disabled (None: not said), with a reasoning parser

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's `enable_thinking` (as Qwen3's templates read it), when `thinking` says."""
        return None if self.thinking is None else {"enable_thinking": self.thinking}


@dataclasses.dataclass(frozen=True)
class MessagesRequest:
    conversation: Conversation
    max_tokens: int  # given; checked against the limit and the context once the prompt is known
    stop_sequences: list[str]
    sampling: dict[str, Any]  # the fields `build_sampling_params` reads
    stream: bool


def parse_messages_request(
    body: dict[str, Any], reasoning: bool = False, images: ImageParts | None = None
) -> MessagesRequest:
    """A `POST /v1/messages` body (its fields already checked against MESSAGES_FIELDS); with
    `reasoning` (a reasoning parser), `thinking` may be enabled; with `images`, image blocks are
    collected there (without, they are refused)."""
    if "max_tokens" not in body:
        raise bad_request("max_tokens: field required", param="max_tokens")
    max_tokens = body["max_tokens"]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise bad_request("max_tokens must be an integer", param="max_tokens")
    stop = body.get("stop_sequences", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop_sequences must be a list of non-empty strings", param="stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", param="stream")
    _check_metadata(body.get("metadata", {}))
    if body.get("service_tier", "auto") not in ("auto", "standard_only"):
        raise bad_request('service_tier must be "auto" or "standard_only"', param="service_tier")
    sampling = {name: body[name] for name in ("temperature", "top_p", "top_k") if name in body}
    if stop:  # kept in the text so the reply can say which one ended it (`stop_sequence`), then cut
        sampling.update(stop=stop, include_stop_str_in_output=True)
    return MessagesRequest(parse_conversation(body, reasoning, images), max_tokens, stop, sampling, stream)


def parse_conversation(body: dict[str, Any], reasoning: bool = False, images: ImageParts | None = None) -> Conversation:
    """`system`, `messages`, `tools`, `tool_choice` and `thinking` of a messages or count_tokens
    body; image blocks, with `images`, collected there in the order of the prompt."""
    thinking = _thinking(body.get("thinking"), reasoning)
    tools = _tools(body.get("tools", []))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    system = _system(body.get("system"))
    messages, prefill = _messages(body.get("messages"), images)
    return Conversation(system + messages, prefill, tools, choice, parallel, thinking)


def _check_metadata(value: Any) -> None:
    if not isinstance(value, dict) or set(value) - {"user_id"}:
        raise bad_request('metadata must be an object with at most "user_id"', param="metadata")
    if not isinstance(value.get("user_id", ""), str):
        raise bad_request("metadata.user_id must be a string", param="metadata")


def _thinking(value: Any, reasoning: bool) -> bool | None:
    """Whether `thinking` asks for thinking (None when it is not given). Only a server with a
    reasoning parser (`--reasoning-parser`) thinks; `budget_tokens` is checked, not enforced."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled" and set(value) == {"type"}:
        return False
    if kind in ("enabled", "adaptive") and not reasoning:
        raise bad_request(
            "extended thinking needs a reasoning parser (this server runs without --reasoning-parser)",
            param="thinking",
        )
    budget = value.get("budget_tokens", 1024) if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive") or set(value) - {"type", "budget_tokens"} or not _positive_int(budget):
        raise bad_request(
            'thinking must be {"type": "disabled"}, {"type": "enabled", "budget_tokens": ...} or {"type": "adaptive"}',
            param="thinking",
        )
    return True


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    if not isinstance(value, list):
        raise bad_request("system must be a string or a list of text blocks", param="system")
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad_request(f"system.{j}: only text blocks may make the system prompt", param="system")
        texts.append(_text(block, f"system.{j}"))
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _messages(value: Any, images: ImageParts | None) -> tuple[list[dict[str, Any]], str]:
    """Chat messages, and the prefill text of a final assistant message (which is not among them)."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of messages", param="messages")
    out: list[dict[str, Any]] = []
    seen_ids: set[str] = set()
    previous_ids: set[str] = set()  # the tool_use ids of the message just before
    prefill = ""
    for i, message in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise bad_request(f'{where} must be an object with "role" and "content"', param="messages")
        role = message.get("role")
        if role not in BLOCKS_BY_ROLE:
            hint = " (give the system prompt as the top-level system field)" if role == "system" else ""
            raise bad_request(f'{where}.role must be "user" or "assistant"{hint}', param="messages")
        if i == 0 and role != "user":
            raise bad_request("the first message must be a user message", param="messages")
        final_assistant = role == "assistant" and i == len(value) - 1
        blocks = _blocks(message.get("content"), where, role, allow_empty=final_assistant)
        if role == "user":
            out += _user_messages(blocks, where, previous_ids, images)
            previous_ids = set()
            continue
        calls = [_tool_call(block, f"{where}.content.{j}", seen_ids) for j, block in enumerate(blocks)]
        calls = [c for c in calls if c is not None]
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        if final_assistant and not calls:
            if text != text.rstrip():
                raise bad_request("final assistant content cannot end with trailing whitespace", param="messages")
            prefill = text
            continue
        previous_ids = {c["id"] for c in calls}
        out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
    return out, prefill


def _blocks(content: Any, where: str, role: str, allow_empty: bool) -> list[dict[str, Any]]:
    """A message's content as checked blocks: {"type": "text", "text"}, tool_use or tool_result."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}] if content or not allow_empty else []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", param="messages")
    if not content and not allow_empty:
        raise bad_request(
            f"{where}: all messages must have non-empty content except for the optional final assistant message",
            param="messages",
        )
    blocks = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "document":
            raise bad_request(f"{at}: document content blocks are not supported", param="messages")
        if kind not in BLOCKS_BY_ROLE[role]:
            raise bad_request(
                f"{at}: a {role} message may hold {' and '.join(BLOCKS_BY_ROLE[role])} blocks, not {kind!r}",
                param="messages",
            )
        keys = {
            "text": TEXT_KEYS,
            "image": IMAGE_KEYS,
            "tool_use": TOOL_USE_KEYS,
            "tool_result": TOOL_RESULT_KEYS,
            **THINKING_KEYS,
        }[kind]
        if set(block) - keys:
            raise bad_request(f"{at} has unsupported fields: {sorted(set(block) - keys)}", param="messages")
        if kind == "text":
            _text(block, at)
        if kind in THINKING_KEYS and not isinstance(block.get("thinking", block.get("data")), str):
            raise bad_request(f"{at}: a {kind} block holds its text as a string", param="messages")
        blocks.append(block)
    return blocks


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str) or not text:
        raise bad_request(f"{where}: text content blocks must hold a non-empty text string", param="messages")
    return text


def _tool_call(block: dict[str, Any], where: str, seen_ids: set[str]) -> dict[str, Any] | None:
    """A tool_use block as a chat tool call (None for a text block)."""
    if block["type"] != "tool_use":
        return None
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not isinstance(arguments, dict):
        raise bad_request(
            f'{where}: a tool_use block needs "id" and "name" strings and an "input" object', param="messages"
        )
    if call_id in seen_ids:
        raise bad_request(f"{where}: the tool_use id {call_id!r} is used twice", param="messages")
    seen_ids.add(call_id)
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _user_messages(
    blocks: list[dict[str, Any]], where: str, open_ids: set[str], images: ImageParts | None
) -> list[dict[str, Any]]:
    """A user message's blocks, in order, as chat messages: each tool_result a "tool" message,
    each run of text and image blocks a user message (text blocks joined by newlines, each image
    its placeholder, with nothing around it)."""
    out: list[dict[str, Any]] = []
    answered: set[str] = set()
    last = None  # the kind of the block before, in the same chat message
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        if block["type"] in ("text", "image"):
            text = block["text"] if block["type"] == "text" else image_block_text(block, at, images)
            if last is None:
                out.append({"role": "user", "content": text})
            else:
                out[-1]["content"] += ("\n" if last == block["type"] == "text" else "") + text
            last = block["type"]
            continue
        last = None
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or call_id not in open_ids:
            raise bad_request(
                f"{at}: unexpected tool_use_id {call_id!r} in a tool_result block: each tool_result must answer "
                "a tool_use block of the previous message",
                param="messages",
            )
        if call_id in answered:
            raise bad_request(f"{at}: tool_use {call_id!r} is answered twice", param="messages")
        answered.add(call_id)
        out.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, at, images)})
    return out


def _tool_result_text(block: dict[str, Any], where: str, images: ImageParts | None) -> str:
    content = block.get("content", "")
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            at = f"{where}.content.{k}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image" and not set(part) - IMAGE_KEYS:
                parts.append(image_block_text(part, at, images))
                continue
            if kind != "text" or set(part) - TEXT_KEYS:
                raise bad_request(f"{at}: a tool result holds text and image blocks only", param="messages")
            parts.append(_text(part, at))
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or a list of text and image blocks", param="messages")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad_request(f"{where}.is_error must be a boolean", param="messages")
    return f"Error: {content}" if is_error else content


def _tools(value: Any) -> list[dict[str, Any]]:
    """Custom tools in chat completions' form, checked by `parse_tools` (messages in Anthropic's terms)."""
    if not isinstance(value, list):
        raise bad_request("tools must be a list of tools", param="tools")
    converted = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise bad_request(f"tools.{i} must be an object", param="tools")
        if tool.get("type", "custom") != "custom":
            raise bad_request(
                f"tools.{i}: only custom tools (name, description, input_schema) are supported, not "
                f"{tool.get('type')!r}",
                param="tools",
            )
        if set(tool) - TOOL_KEYS:
            raise bad_request(f"tools.{i} has unsupported fields: {sorted(set(tool) - TOOL_KEYS)}", param="tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad_request(f'tools.{i}.input_schema must be a JSON schema with "type": "object"', param="tools")
        function = {"name": tool.get("name"), **({"description": tool["description"]} if "description" in tool else {})}
        function.update(parameters=schema, **({"strict": tool["strict"]} if "strict" in tool else {}))  # chat's order
        converted.append({"type": "function", "function": function})
    try:
        return parse_tools({"tools": converted})
    except APIError as e:
        message = e.message.replace(".function.parameters", ".input_schema").replace(".function.", ".")
        raise bad_request(message.replace("tools[", "tools.").replace("]", "", 1), param="tools") from None


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[ToolChoice, bool]:
    """(choice, parallel) of Anthropic's tool_choice: auto, any, tool (by name) or none."""
    if value is None:
        return parse_tool_choice({}, tools), True
    kind = value.get("type") if isinstance(value, dict) else None
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if kind not in ("auto", "any", "tool", "none") or set(value) - allowed:
        raise bad_request(
            'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}',
            param="tool_choice",
        )
    disable = value.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice")
    if kind in ("any", "tool") and not tools:
        raise bad_request(f'tool_choice "{kind}" needs tools', param="tool_choice")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names the tool {name!r}, which is not in tools", param="tool_choice")
        chat_choice: Any = {"type": "function", "function": {"name": name}}
    else:
        chat_choice = TOOL_CHOICES[kind]
    return parse_tool_choice({"tool_choice": chat_choice}, tools), not disable
