"""A response being made (`Turn`), and what is stored when it ends: the response, the items its
conversation gets, and the KV pin of its conversation or chain."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from jaxserve.image_prompt import PromptImage, cache_token_ids
from jaxserve.sampling_params import SamplingParams
from server.errors import APIError
from server.openai_bodies import ChoiceOutput, UsageCount
from server.prompts import reply_token_ids
from server.response_prompt import PriorContext, kept_images
from server.response_request import ResponseRequest
from server.response_shapes import ResponseShapes
from server.sessions import Message, Session
from server.state import ServerState


@dataclasses.dataclass
class Turn:
    """A response being made: its request, prompt and settings, and what it continues."""

    request: ResponseRequest
    shapes: ResponseShapes
    context: PriorContext  # the stored response or conversation it continues
    chain: str  # the id of its chain's first response: where its KV lives
    prompt_ids: list[int]
    params: SamplingParams
    images: tuple[PromptImage, ...] = ()  # the rows of its prompt's images among `prompt_ids`
    image_urls: tuple[str, ...] = ()  # their urls (its context's, then its input's)

    def record(self, body: dict[str, Any]) -> dict[str, Any]:
        """What the stored response keeps besides its messages (`Session.response`), its prompt's
        images among them (for a response that continues it)."""
        record = {"object": body, "input_items": self.request.items, "chain": self.chain}
        return {**record, "context_images": kept_images(self.image_urls)} if self.image_urls else record


async def finish(state: ServerState, owner: str, turn: Turn, choice: ChoiceOutput, usage: UsageCount) -> dict[str, Any]:
    """The finished response's body, stored first when it is to be."""
    turn.shapes.count_reasoning(choice, usage)
    status, output = turn.shapes.reply(choice)
    body = turn.shapes.body(status, output, usage)
    await save(state, owner, turn, choice, body)
    return body


async def save(state: ServerState, owner: str, turn: Turn, choice: ChoiceOutput, body: dict[str, Any]) -> None:
    """Store a finished response (with `store`), add its items to its conversation, and pin the
    KV of its conversation, or of its chain of stored responses (its images' rows salted by their
    digests, as the prefix cache keys them)."""
    ids = cache_token_ids(turn.prompt_ids + choice.token_ids, turn.images)
    conversation = turn.context.conversation
    if conversation is not None:
        conversation.model = turn.shapes.info.name  # (its pin is of this model's KV)
        items = [*conversation.response["items"], *turn.request.items, *body["output"]]
        state.responses.change_conversation(conversation, items=items)
        state.spawn(state.session_kv.pin_history(conversation, ids))
    if not turn.request.store:
        return
    history = [*turn.context.history, *turn.request.messages]
    messages = [*history, reply_message(state, turn, choice, body["output"])]
    record = turn.record(body)
    session = state.sessions.find(owner, turn.shapes.id, "response")  # a background one is stored already
    if session is None:
        session = await state.responses.create(owner, turn.shapes.info.name, turn.shapes.id, messages, record)
    else:
        state.sessions.commit(session, messages, record)
    if conversation is None:
        state.spawn(state.session_kv.pin_history(session, ids, replacing=turn.context.previous))


def reply_message(state: ServerState, turn: Turn, choice: ChoiceOutput, output: list[dict[str, Any]]) -> Message:
    """The reply as the stored conversation holds it: the model's token ids with its text, or its calls."""
    calls = [item for item in output if item["type"] == "function_call"]
    if calls:
        text = next((item["content"][0]["text"] for item in output if item["type"] == "message"), "")
        return {
            "role": "assistant",
            "content": text,
            "tool_calls": [
                {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls
            ],
        }
    message: Message = {"role": "assistant", "content": choice.text}
    ids = reply_token_ids(state.info, [], choice.token_ids, choice.text, turn.params.skip_special_tokens)
    if ids is not None:
        message["token_ids"] = ids
    return message


def commit(state: ServerState, session: Session, body: dict[str, Any]) -> None:
    with contextlib.suppress(APIError):  # not written (logged): it shows as failed after a restart
        state.sessions.commit(session, session.messages, {**session.response, "object": body})
