"""`GenerateRequest` -> prompt token ids and `SamplingParams`, by the HTTP API's rules.

The message is turned into what the HTTP routes see (a prompt, chat messages, a dict of the
sampling fields that are set) and checked by the same helpers, so both APIs accept and refuse
the same values with the same messages.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from jaxserve.sampling_params import SamplingParams
from server.errors import bad_request
from server.grpc_api import jaxserve_pb2 as pb
from server.model_info import ModelInfo
from server.prompts import encode_chat, parse_messages, prompt_ids_or_400
from server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    Limits,
    build_sampling_params,
    check_model,
    logprobs_setting,
    max_tokens_setting,
)


def set_fields(message: Message) -> dict[str, Any]:
    """The fields given in `message` (unset optional fields and empty lists and maps are left
    out, as JSON's null and absent fields are); maps become dicts, lists lists."""

    def plain(field: Any, value: Any) -> Any:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            return dict(value)
        return list(value) if field.is_repeated else value

    return {field.name: plain(field, value) for field, value in message.ListFields()}


def prompt_ids(request: pb.GenerateRequest, info: ModelInfo) -> tuple[list[int], bool]:
    """The prompt's token ids, and whether it is a chat."""
    kind = request.WhichOneof("prompt")
    if kind == "messages":
        messages = parse_messages([{"role": m.role, "content": m.content} for m in request.messages.messages])
        return prompt_ids_or_400(encode_chat(info, messages), info, "messages"), True
    if kind == "text":
        return prompt_ids_or_400(info.tokenizer.encode(request.text, add_special_tokens=True), info), False
    if kind == "token_ids":
        return prompt_ids_or_400(list(request.token_ids.ids), info), False
    raise bad_request("the request has no prompt: set text, token_ids or messages", param="prompt")


def parse_generate(request: pb.GenerateRequest, info: ModelInfo, limits: Limits) -> tuple[list[int], SamplingParams]:
    """Prompt ids and sampling parameters, or `APIError` (400 bad value, 404 other model)."""
    check_model({"model": request.model} if request.model else {}, info.name)
    ids, chat = prompt_ids(request, info)
    body = set_fields(request.sampling_params)
    default = None if chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = max_tokens_setting(body, limits, len(ids), default)
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs_setting(body, chat=False),
        max_n=limits.max_n,
        vocab_size=info.vocab_size,
    )
    return ids, params
