"""What the Responses API shows: the `response` object and its output items.

A reply becomes, in this order, a `reasoning` item (with a reasoning parser: its reasoning, as one
`reasoning_text` part), a `message` item (its text, as one `output_text` part) and a
`function_call` item per tool call (`server.reply_stream` finds them, as for chat completions). A
reply cut by `max_output_tokens` is `incomplete` (`incomplete_details.reason: "max_output_tokens"`),
and so are its items. The events of a streamed response are `server.response_events`'.
"""

from __future__ import annotations

import time
from typing import Any

from jaxserve.outputs import TokenLogprob
from server.model_info import ModelInfo
from server.openai_bodies import ChoiceOutput, UsageCount, chat_logprobs
from server.reply_stream import ReplyParsing, ReplyParts
from server.response_items import item_id
from server.tools import ToolCall


def usage_body(usage: UsageCount) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseShapes:
    """The response object and its output items, for one response (its id, settings and model)."""

    def __init__(
        self,
        response_id: str,
        info: ModelInfo,
        echo: dict[str, Any],
        parsing: ReplyParsing | None,
        created_at: int | None = None,
    ) -> None:
        self.id = response_id
        self.info = info
        self.echo = echo
        self.parsing = parsing
        self.created_at = int(time.time()) if created_at is None else created_at
        self.message_id = item_id("msg")
        self.reasoning_id = item_id("rs")
        self._call_ids: list[tuple[str, str]] = []  # (item id, call id) of each call, made once

    def body(
        self, status: str, output: list[dict[str, Any]], usage: UsageCount | None, error: dict[str, str] | None = None
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.info.name,
            "output": output,
            **self.echo,
            "usage": usage_body(usage) if usage is not None else None,
        }

    def parts(self, choice: ChoiceOutput) -> ReplyParts:
        if self.parsing is None:
            return ReplyParts(None, choice.text, [], choice.finish_reason)
        return self.parsing.parts(choice.text, choice.finish_reason)

    def count_reasoning(self, choice: ChoiceOutput, usage: UsageCount) -> None:
        """Set the usage's reasoning tokens from the finished reply."""
        if self.parsing is not None:
            usage.reasoning_tokens = self.parsing.reasoning_tokens(self.info.tokenizer, choice.token_ids)

    def reply(
        self,
        choice: ChoiceOutput,
        parts: ReplyParts | None = None,
        keep_message: bool = False,
        keep_reasoning: bool = False,
    ) -> tuple[str, list[dict[str, Any]]]:
        """(status, output items) of a finished reply (its `parts`, when a stream has parsed them
        already); the message item is left out when the reply is only calls, the reasoning item when
        it has none (unless a stream has opened them: `keep_message`, `keep_reasoning`)."""
        parts = parts if parts is not None else self.parts(choice)
        status = "incomplete" if parts.finish_reason == "length" else "completed"
        output = []
        if parts.reasoning or keep_reasoning:
            output.append(self.reasoning(parts.reasoning or "", status))
        if parts.content or not parts.calls or keep_message:
            output.append(self.message(parts.content or "", status, choice.logprobs))
        output += [self.call(i, call, status) for i, call in enumerate(parts.calls)]
        return status, output

    def reasoning(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None,
            "status": status,
        }

    def message(self, text: str, status: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [self.text_part(text, logprobs)],
        }

    def text_part(self, text: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        shown = chat_logprobs(self.info, logprobs)["content"] if logprobs is not None else []
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": shown}

    def call_ids(self, index: int) -> tuple[str, str]:
        """(item id, call id) of the reply's call `index`, made once."""
        while len(self._call_ids) <= index:
            self._call_ids.append((item_id("fc"), item_id("call")))
        return self._call_ids[index]

    def call(self, index: int, call: ToolCall, status: str) -> dict[str, Any]:
        fc_id, call_id = self.call_ids(index)
        return {
            "type": "function_call",
            "id": fc_id,
            "call_id": call_id,
            "name": call.name,
            "arguments": call.arguments,
            "status": status,
        }
