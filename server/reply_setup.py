"""A chat request's prompt and reply setup, shared by chat completions, Responses and Messages:
its prompt's token ids with the tools shown, `chat_template_kwargs`, and the `ReplyParsing`
(reasoning parser, tool calls) that its replies are read with."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxserve.sampling_params import SamplingParams
from server.errors import bad_request
from server.harmony import is_harmony_template
from server.image_parts import ImageParts
from server.model_info import ModelInfo
from server.prompts import encode_chat, render_chat
from server.reasoning import ReasoningParser
from server.reply_stream import ReplyParsing
from server.tools import ToolCalling, ToolChoice, ToolFormat

# Variables the server itself gives the template; a request may not set them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "template"})


def template_kwargs_setting(body: dict[str, Any], name: str = "chat_template_kwargs") -> dict[str, Any]:
    """The request's extra chat template variables (vLLM's `chat_template_kwargs`, such as
    `{"enable_thinking": false}`); 400 for anything but an object of names."""
    value = body.get(name, {})
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise bad_request(f"{name} must be an object of template variable names to values", param=name)
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(value))
    if reserved:
        raise bad_request(f"{name} may not set {reserved}: the server sets them", param=name)
    return value


def chat_prompt_ids(
    info: ModelInfo,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    choice: ToolChoice,
    template_kwargs: dict[str, Any] | None = None,
    images: ImageParts | None = None,
) -> tuple[list[int], ToolCalling | None]:
    """The prompt's token ids (not checked against the model's limits) with `tools` shown in the
    model's tool format (none with tool_choice "none"), and the tool calling its reply is read
    with (None when no tools are shown). With loaded `images`, their rows are placed in it
    (`ImageParts.encode`)."""
    tool_format = ToolFormat(info.template, tools)
    shown_tools = tools if choice.mode != "none" else []
    messages, template_tools = tool_format.prompt(messages, shown_tools)
    if images:
        ids = images.encode(render_chat(info, messages, tools=template_tools, template_kwargs=template_kwargs))
    else:
        ids = encode_chat(info, messages, tools=template_tools, template_kwargs=template_kwargs)
    return ids, (ToolCalling(tool_format, choice) if shown_tools else None)


def check_reasoning_parser(name: str | None, template: str | None) -> None:
    """ValueError (at start-up) when `--reasoning-parser` does not fit the chat template's format."""
    harmony = is_harmony_template(template)
    if name == "openai_gptoss" and not harmony:
        raise ValueError(
            "reasoning parser openai_gptoss reads harmony channels; this chat template does not write them"
        )
    if name is not None and name != "openai_gptoss" and harmony:
        raise ValueError(
            f"this chat template writes harmony (gpt-oss's channels): reasoning parser {name} cannot read it"
        )


def reply_parsing(
    info: ModelInfo,
    reasoning_parser: str | None,
    tools: ToolCalling | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
) -> tuple[ReplyParsing | None, SamplingParams]:
    """How the request's replies are read (None when they are plain text), and the sampling
    parameters to generate them with. A reply held to JSON or a choice (structured output, a
    forced call) is that from its first token, so it has no reasoning; a regex or grammar may write
    a think block, and is read for one. A harmony template's replies (gpt-oss's) are read as
    channels whatever the reasoning parser, and keep their special tokens, which mark them."""
    if params.guided is not None and params.guided.kind not in ("regex", "grammar"):
        return (ReplyParsing(tools) if tools is not None else None), params
    if is_harmony_template(info.template):
        return ReplyParsing(tools, harmony=True), dataclasses.replace(params, skip_special_tokens=False)
    reasoning = None
    if reasoning_parser is not None:
        reasoning = ReasoningParser.for_prompt(reasoning_parser, info.tokenizer, prompt_ids)
    if tools is None and reasoning is None:
        return None, params
    return ReplyParsing(tools, reasoning), params
