"""What the Responses API shows: the `response` object, its output items, and the events of a
streamed response.

A reply becomes a `message` item (its text, as one `output_text` part) and a `function_call` item
per tool call (`ToolCalling.reply` finds them, as for chat completions). A reply cut by
`max_output_tokens` is `incomplete` (`incomplete_details.reason: "max_output_tokens"`), and so are
its items. A stream sends OpenAI's event sequence, each event with its `sequence_number`:
`response.created`, `response.in_progress`, then per item `response.output_item.added`, for the
message `response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, for a call `response.function_call_arguments.delta` and `.done`, then
`response.output_item.done`; and last `response.completed` (or `.incomplete`, or `.failed`).
"""

from __future__ import annotations

import time
from typing import Any

from jaxserve.outputs import Delta, TokenLogprob
from server.model_info import ModelInfo
from server.openai_bodies import ChoiceOutput, UsageCount, chat_logprobs
from server.response_request import item_id
from server.tools import ToolCall, ToolCalling


def usage_body(usage: UsageCount) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseShapes:
    """The response object and its output items, for one response (its id, settings and model)."""

    def __init__(
        self,
        response_id: str,
        info: ModelInfo,
        echo: dict[str, Any],
        tools: ToolCalling | None,
        created_at: int | None = None,
    ) -> None:
        self.id = response_id
        self.info = info
        self.echo = echo
        self.tools = tools
        self.created_at = int(time.time()) if created_at is None else created_at
        self.message_id = item_id("msg")
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

    def reply(self, choice: ChoiceOutput, keep_message: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(status, output items) of a finished reply; the message item is left out when the
        reply is only calls (unless `keep_message`: a stream has opened it)."""
        if self.tools is None:
            content, calls, reason = choice.text, [], choice.finish_reason
        else:
            content, calls, reason = self.tools.reply(choice.text, choice.finish_reason)
        status = "incomplete" if reason == "length" else "completed"
        output = []
        if content or not calls or keep_message:
            output.append(self.message(content or "", status, choice.logprobs))
        output += [self.call(i, call, status) for i, call in enumerate(calls)]
        return status, output

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

    def call(self, index: int, call: ToolCall, status: str) -> dict[str, Any]:
        while len(self._call_ids) <= index:
            self._call_ids.append((item_id("fc"), item_id("call")))
        fc_id, call_id = self._call_ids[index]
        return {
            "type": "function_call",
            "id": fc_id,
            "call_id": call_id,
            "name": call.name,
            "arguments": call.arguments,
            "status": status,
        }


class ResponseEvents:
    """The events of one streamed response, made as its deltas arrive."""

    def __init__(self, shapes: ResponseShapes) -> None:
        self.shapes = shapes
        self.sequence = 0
        self._text = ""  # the reply so far
        self._shown = 0  # of it, sent as output text
        self._message_open = False

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        body = self.shapes.body("in_progress", [], None)
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        """The text a delta adds, as far as it may be shown yet (not what may become a tool call)."""
        self._text += delta.text
        tools = self.shapes.tools
        end = len(self._text) if tools is None else max(self._shown, tools.shown(self._text))
        if end <= self._shown:
            return []
        events = self._open_message()
        piece, self._shown = self._text[self._shown : end], end
        shown = delta.logprobs if tools is None else None  # (with tools, text and tokens may part ways)
        logprobs = chat_logprobs(self.shapes.info, shown)["content"] if shown else []
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self.shapes.message_id,
                output_index=0,
                content_index=0,
                delta=piece,
                logprobs=logprobs,
            )
        )
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        if self._message_open:
            return []
        self._message_open = True
        item = {
            "type": "message",
            "id": self.shapes.message_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=0, item=item),
            self.event(
                "response.content_part.added",
                item_id=self.shapes.message_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def finish(self, choice: ChoiceOutput, usage: UsageCount) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The events that close the output items and the response, and the response's body."""
        status, output = self.shapes.reply(choice, keep_message=self._message_open)
        events = []
        for index, item in enumerate(output):
            if item["type"] == "message":
                events += self._open_message()
                text = item["content"][0]["text"]
                if len(text) > self._shown:
                    events.append(
                        self.event(
                            "response.output_text.delta",
                            item_id=item["id"],
                            output_index=index,
                            content_index=0,
                            delta=text[self._shown :],
                            logprobs=[],
                        )
                    )
                part = item["content"][0]
                events += [
                    self.event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=text,
                        logprobs=part["logprobs"],
                    ),
                    self.event(
                        "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                    ),
                ]
            else:
                events += [
                    self.event(
                        "response.output_item.added",
                        output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"},
                    ),
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=item["arguments"],
                    ),
                    self.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    ),
                ]
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        body = self.shapes.body(status, output, usage)
        events.append(self.event(f"response.{status}", response=body))
        return events, body

    def failed(self, code: str, message: str) -> dict[str, Any]:
        body = self.shapes.body("failed", [], None, error={"code": code, "message": message})
        return self.event("response.failed", response=body)
