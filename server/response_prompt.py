"""A response's prompt: what it continues (a stored response, or a conversation's items), then its
input, with `truncation: "auto"` dropping the oldest of them when they do not fit the context.

With `truncation: "disabled"` (the default) a prompt that does not fit, with the output it asks
for, is a 400 (`context_length_exceeded`). With "auto" the oldest messages of the prior context
and the input go first (never a system message: the instructions stay), with the results of the
calls they made, until the prompt and `max_output_tokens` (at least one token) fit; when even
the last message alone does not fit, it is the same 400. A prompt with images is never truncated
(its images' placeholders stay where they are): it fits, or it is that 400.

Images go on with what is continued: a stored response keeps the urls of its context's images (its
chain's and its input's, in prompt order; each distinct url once, keyed by its SHA-256) with its
record, which is written, expires and is deleted with it; a conversation's items keep theirs. The
continuation's prompt places them again (their placeholders are in the stored text), so it is the
prompt of the whole conversation sent as input, and the prefix cache, keyed by the images' hashes,
holds its start. They count with the input's images against the per-request limit (a 400 beyond
it), and their messages are never dropped by `truncation: "auto"`. A `file://` image is kept as
its url, read again (under `--allowed-local-media-path`) when the chain goes on.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from server.errors import bad_request
from server.image_parts import ImageParts
from server.model_info import ModelInfo
from server.reply_setup import chat_prompt_ids
from server.response_items import messages_of
from server.response_request import ResponseRequest
from server.response_store import ResponseStore
from server.sessions import Message, Session
from server.tools import ToolCalling


@dataclasses.dataclass(frozen=True)
class PriorContext:
    """What a response continues: a stored response (`previous`) or a conversation, and the
    messages either gives its prompt (`history`)."""

    previous: Session | None
    conversation: Session | None
    history: list[Message]
    images: int = 0  # how many images `history` holds (placed before the input's)


def prior_context(
    responses: ResponseStore, owner: str, req: ResponseRequest, model: str, images: ImageParts
) -> PriorContext:
    """The context of `previous_response_id` or `conversation` (404 when the key has none such),
    its images put before the input's in `images`."""
    if req.conversation is not None:
        conversation = responses.conversation(owner, req.conversation, param="conversation")
        found = images.collector("conversation")
        history = messages_of(conversation.response["items"], found)
        images.prepend(found.urls, "conversation")
        return PriorContext(None, conversation, history, len(found.urls))
    if req.previous_response_id is None:
        return PriorContext(None, None, [])
    previous = responses.previous(owner, req.previous_response_id)
    if previous.model != model:
        raise bad_request(
            f"response {req.previous_response_id} was made by model {previous.model!r}; its chain "
            f"cannot go on with {model!r} (their KV differs)",
            param="model",
            code="model_mismatch",
        )
    urls = stored_image_urls(previous.response, req.previous_response_id)
    images.prepend(urls, "previous_response_id")
    return PriorContext(previous, None, previous.messages, len(urls))


def kept_images(urls: tuple[str, ...]) -> dict[str, Any]:
    """What a stored response keeps of its context's images: their order, and each distinct url once."""
    keys = [hashlib.sha256(url.encode()).hexdigest() for url in urls]
    return {"order": keys, "urls": dict(zip(keys, urls))}


def stored_image_urls(record: dict[str, Any], response_id: str) -> list[str]:
    """The urls of a stored response's context images, in prompt order (`kept_images`); a 400 for
    one with images stored by a server that did not keep them (it kept only their count)."""
    kept = record.get("context_images")
    if kept is not None:
        return [kept["urls"][key] for key in kept["order"]]
    if record.get("images"):
        raise bad_request(
            f"response {response_id} was stored without its images, which a chain then did not carry: "
            "send the whole conversation, its images included, as input",
            param="previous_response_id",
        )
    return []


def within_message_limit(context: PriorContext, req: ResponseRequest, limit: int) -> PriorContext:
    """The context, with the reply and the input, within `limit` messages (`--max-session-messages`):
    a 400 beyond it, or with `truncation: "auto"` its oldest messages dropped as `fitted_prompt` drops them."""
    excess = len(context.history) + len(req.messages) + 1 - limit
    if excess <= 0:
        return context
    dropping = req.truncation and not context.images  # (an image's message stays with its image)
    history = _without_oldest(context.history, excess) if dropping else context.history
    if len(history) + len(req.messages) + 1 > limit:
        raise bad_request(f"a chain of responses holds at most {limit} messages", param="input")
    return dataclasses.replace(context, history=history)


def fitted_prompt(
    info: ModelInfo, messages: list[Message], req: ResponseRequest, output_tokens: int, images: ImageParts
) -> tuple[list[int], ToolCalling | None]:
    """The prompt's token ids (with the loaded `images` in it) and tool calling; with
    `req.truncation` and no images, those of the fewest oldest messages dropped that leave room for
    `output_tokens` (unchecked when none do: the caller's checks answer with the 400)."""
    shown_tools = req.tools if req.tool_choice.mode != "none" else []

    def encode(drop: int) -> tuple[list[int], ToolCalling | None]:
        return chat_prompt_ids(info, _without_oldest(messages, drop), shown_tools, req.tool_choice, images=images)

    ids, calling = encode(0)
    droppable = sum(m["role"] not in ("system", "tool") for m in messages) - 1  # the newest turn stays
    fits = len(ids) + output_tokens <= info.max_model_len
    if fits or not req.truncation or droppable < 1 or images:
        return ids, calling
    low, high = 1, droppable  # the prompt shrinks as more go: find the fewest dropped that fit
    while low < high:
        mid = (low + high) // 2
        if len(encode(mid)[0]) + output_tokens <= info.max_model_len:
            high = mid
        else:
            low = mid + 1
    return encode(low)


def _without_oldest(messages: list[Message], drop: int) -> list[Message]:
    """`messages` without the `drop` oldest that are not system messages (nor tool results, which
    go when they are left at the front, their call gone)."""
    kept: list[Message] = []
    dropped = 0
    for message in messages:
        role = message["role"]
        if role == "system":
            kept.append(message)
        elif dropped < drop and role != "tool":
            dropped += 1
        elif role != "tool" or not dropped or any(m["role"] != "system" for m in kept):
            kept.append(message)
    return kept


def context_messages(instructions: str | None, history: list[Message], messages: list[dict[str, Any]]) -> list[Message]:
    """The prompt's messages: the instructions as a system message, the prior context, the input."""
    head = [{"role": "system", "content": instructions}] if instructions is not None else []
    return [*head, *history, *messages]
