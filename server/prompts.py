"""Prompts -> token ids: completion prompts (text or ids, one or many) and chat messages.

Everything here is validation plus the tokenizer, safe on the asyncio thread. A prompt that
leaves no room to generate within the context is a 400 with code `context_length_exceeded`.
"""

from __future__ import annotations

from typing import Any

import jinja2

from jaxserve.engine_client import PromptTooLongError
from jaxserve.engine_client import check_prompt_ids as check_engine_prompt_ids
from server.errors import bad_request
from server.image_parts import IMAGE_PART_TYPES, ImageParts
from server.model_info import ModelInfo

CHAT_ROLES = {"system", "developer", "user", "assistant"}
_MARK = "\ue000"  # a private-use character: marks where a message's stored token ids go
MESSAGE_FIELDS = {"role", "content", "name", "refusal", "tool_calls"}
TOOL_MESSAGE_FIELDS = MESSAGE_FIELDS | {"tool_call_id"}


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def prompt_ids_or_400(ids: list[int], info: ModelInfo, param: str = "prompt") -> list[int]:
    """The ids, checked as the engine checks them (`jaxserve.engine_client.check_prompt_ids`); a 400
    naming `param` if they fail."""
    try:
        return check_engine_prompt_ids(ids, info.vocab_size, info.max_model_len)
    except PromptTooLongError as e:
        raise bad_request(str(e), param=param, code="context_length_exceeded") from None
    except ValueError as e:
        raise bad_request(str(e), param=param) from None


def completion_prompts(body: dict[str, Any], info: ModelInfo, max_prompts: int) -> list[tuple[str, list[int]]]:
    """`prompt` as a string, a list of strings, a list of token ids, or a list of such lists:
    each prompt's text (token ids decoded, special tokens kept) and token ids."""
    if "prompt" not in body:
        raise bad_request("prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request(
            "prompt must be a non-empty string, a list of strings, a list of token ids, or a list of token id lists",
            param="prompt",
        )
    if len(prompts) > max_prompts:
        raise bad_request(f"at most {max_prompts} prompts per request", param="prompt")
    tokenizer = info.tokenizer
    out = []
    for p in prompts:
        ids = prompt_ids_or_400(tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p), info)
        out.append((p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False), ids))
    return out


def _content_text(content: Any, index: int, images: ImageParts | None = None) -> str:
    """A message's content as text; its image parts (with `images`) as the model's placeholder."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if images is not None and kind in IMAGE_PART_TYPES:
                parts.append(images.take(part, f"messages[{index}].content"))
                continue
            if kind != "text" or not isinstance(part.get("text"), str):
                what = "text and image parts are" if images is not None else "only text parts are"
                raise bad_request(f"messages[{index}].content: {what} supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def parse_messages(
    value: Any, param: str = "messages", tools: bool = False, images: ImageParts | None = None
) -> list[dict[str, Any]]:
    """Chat messages as plain {"role", "content"} dicts (developer -> system). With `tools` (chat
    completions), also "tool" messages (with their `tool_call_id`) and assistant messages with
    `tool_calls` (kept under that key, with content "" when they have none). With `images`, image
    parts are collected there and shown in the content as the model's image placeholder."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"{param} must be a non-empty list of messages", param=param)
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_request(f"{param}[{i}] must be an object", param=param)
        unknown = set(message) - (TOOL_MESSAGE_FIELDS if tools else MESSAGE_FIELDS)
        if unknown:
            raise bad_request(f"{param}[{i}] has unsupported fields: {sorted(unknown)}", param=param)
        role = message.get("role")
        roles = CHAT_ROLES | {"tool"} if tools else CHAT_ROLES
        if not isinstance(role, str) or role not in roles:
            raise bad_request(f"{param}[{i}].role must be one of {sorted(roles)}", param=param)
        if message.get("tool_calls"):
            if not tools or role != "assistant":
                raise bad_request(
                    f"{param}[{i}]: only assistant messages of chat completions may hold tool calls", param=param
                )
            messages.append(
                {
                    "role": role,
                    "content": _content_text(message.get("content") or "", i),
                    "tool_calls": _tool_calls(message["tool_calls"], f"{param}[{i}]", param),
                }
            )
            continue
        for name in ("name", "refusal"):
            if message.get(name) is not None and not isinstance(message[name], str):
                raise bad_request(f"{param}[{i}].{name} must be a string", param=param)
        content = message.get("content")
        if content is None and role != "assistant":
            raise bad_request(f"{param}[{i}].content is required", param=param)
        text = "" if content is None else _content_text(content, i, images)
        parsed = {"role": "system" if role == "developer" else role, "content": text}
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise bad_request(f"{param}[{i}].tool_call_id must be a string", param=param)
            parsed["tool_call_id"] = message["tool_call_id"]
        messages.append(parsed)
    return messages


def _tool_calls(value: Any, where: str, param: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, checked: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(value, list):
        raise bad_request(f"{where}.tool_calls must be a list", param=param)
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise bad_request(
                f'{where}.tool_calls[{j}] must be {{"id", "type": "function", "function": {{"name": str, '
                f'"arguments": str}}}}',
                param=param,
            )
        calls.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return calls


def render_chat(
    info: ModelInfo,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation, from the model's chat template (given `tools` too, and
    a request's `chat_template_kwargs` as template variables)."""
    keys = ("role", "content", "tool_calls", "tool_call_id")
    plain = [{k: m[k] for k in keys if k in m} for m in messages]
    try:
        return info.tokenizer.apply_chat_template(
            plain,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template=info.chat_template,
            **(template_kwargs or {}),
        )
    except (ValueError, jinja2.TemplateError) as e:
        raise bad_request(
            f"the conversation cannot be rendered with the model's chat template: {e}", param="messages"
        ) from None


def encode_chat(
    info: ModelInfo,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of a conversation: its rendered text, encoded as written, except that an
    assistant message carrying `token_ids` (the ids the model generated for it, which a
    session stores) contributes exactly those ids.

    Encoding a reply's text again need not give back the ids the model produced (BPE has
    several spellings of one text; special tokens and U+FFFD decode to text that encodes to
    other tokens, sometimes many more). With the stored ids a session's next prompt starts with
    exactly the ids of its previous prompt plus the reply, so the prefix cache holds all of it
    and the turn costs what the reply cost. The template is rendered with a marker in place of
    each such content, and the text between markers is encoded piece by piece. If the template
    does not render each marker once and in order (it rewrote the content), the whole text is
    encoded instead.
    """
    with_ids = [i for i, m in enumerate(messages) if m.get("token_ids") is not None]
    if not with_ids or any(_MARK in m["content"] for m in messages):
        return info.tokenizer.encode(render_chat(info, messages, add_generation_prompt, tools, template_kwargs))
    marked = [dict(m, content=f"{_MARK}{i}{_MARK}") if i in with_ids else m for i, m in enumerate(messages)]
    pieces = render_chat(info, marked, add_generation_prompt, tools, template_kwargs).split(_MARK)
    if pieces[1::2] != [str(i) for i in with_ids]:
        return info.tokenizer.encode(render_chat(info, messages, add_generation_prompt, tools, template_kwargs))
    ids: list[int] = []
    for text, i in zip(pieces[0::2], with_ids):
        ids += info.tokenizer.encode(text) if text else []
        ids += messages[i]["token_ids"]
    return ids + (info.tokenizer.encode(pieces[-1]) if pieces[-1] else [])


def reply_token_ids(
    info: ModelInfo, prefix_ids: list[int], generated: list[int], text: str, skip_special_tokens: bool
) -> list[int] | None:
    """The ids to store with an assistant message whose content is `text`: `prefix_ids` (the
    ids the prompt already held of it, when continuing) plus the generated ids, without a final
    stop token that the text does not show (the template writes its own end-of-turn).
    None when those ids do not decode to `text` (a stop string cut the text, say): the message
    is then encoded from its text."""
    for ids in (prefix_ids + generated[:-1], prefix_ids + generated):  # a last token that shows nothing goes
        if info.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == text:
            return ids
    return None
