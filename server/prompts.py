"""Prompts -> token ids: completion prompts (text or ids, one or many) and chat messages.

Everything here is validation plus the tokenizer, safe on the asyncio thread. A prompt that
leaves no room to generate within the context is a 400 with code `context_length_exceeded`.
"""

from __future__ import annotations

from typing import Any

import jinja2

from server.errors import bad_request
from server.model_info import ModelInfo

CHAT_ROLES = {"system", "developer", "user", "assistant"}
MESSAGE_FIELDS = {"role", "content", "name", "refusal", "tool_calls"}


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def check_prompt_ids(ids: list[int], info: ModelInfo, param: str = "prompt") -> list[int]:
    if not ids:
        raise bad_request("the prompt is empty", param=param)
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        raise bad_request(f"prompt token ids must be in [0, {info.vocab_size})", param=param)
    if len(ids) >= info.max_model_len:
        raise bad_request(
            f"this model's maximum context length is {info.max_model_len} tokens, and the prompt has "
            f"{len(ids)} tokens (at least one token must be left to generate)",
            param=param, code="context_length_exceeded",
        )
    return ids


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
        ids = check_prompt_ids(tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p), info)
        out.append((p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False), ids))
    return out


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts", param="messages")


def parse_messages(value: Any, param: str = "messages") -> list[dict[str, str]]:
    """Chat messages as plain {"role", "content"} dicts (developer -> system)."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"{param} must be a non-empty list of messages", param=param)
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_request(f"{param}[{i}] must be an object", param=param)
        unknown = set(message) - MESSAGE_FIELDS
        if unknown:
            raise bad_request(f"{param}[{i}] has unsupported fields: {sorted(unknown)}", param=param)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{param}[{i}].role must be one of {sorted(CHAT_ROLES)}", param=param)
        if message.get("tool_calls"):
            raise bad_request(f"{param}[{i}]: tool calls are not supported", param=param)
        content = message.get("content")
        if content is None and role != "assistant":
            raise bad_request(f"{param}[{i}].content is required", param=param)
        text = "" if content is None else _content_text(content, i)
        messages.append({"role": "system" if role == "developer" else role, "content": text})
    return messages


def render_chat(info: ModelInfo, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation, from the model's chat template."""
    try:
        return info.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad_request(f"the conversation cannot be rendered with the model's chat template: {e}",
                          param="messages") from None
