"""The events of a streamed Responses API response, made as its deltas arrive.

OpenAI's sequence, each event with its `sequence_number`: `response.created`,
`response.in_progress`; then the output items in the order the reply writes them, each opened with
`response.output_item.added` as it starts: the reasoning (`response.content_part.added`,
`response.reasoning_text.delta`...), the message (`response.content_part.added`,
`response.output_text.delta`...), each tool call (its name and id first, then
`response.function_call_arguments.delta`... as the arguments are written, `server.tool_stream`).
When the reply ends, each item is closed in order (`response.reasoning_text.done` /
`response.output_text.done` and `response.content_part.done`, or
`response.function_call_arguments.done`; then `response.output_item.done`), and last comes
`response.completed` (or `.incomplete`, or `.failed`).
"""

from __future__ import annotations

from typing import Any

from jaxserve.outputs import Delta
from server.openai_bodies import ChoiceOutput, UsageCount, chat_logprobs
from server.reply_stream import ReplyParsing, ReplyStream
from server.response_shapes import ResponseShapes
from server.tool_stream import Arguments, CallStart, Content, Event, Reasoning

_TEXT_PARTS = {"reasoning": "reasoning_text", "message": "output_text"}


class ResponseEvents:
    """The events of one streamed response."""

    def __init__(self, shapes: ResponseShapes) -> None:
        self.shapes = shapes
        self.sequence = 0
        self._text = ""  # the reply so far
        self._stream = ReplyStream(shapes.parsing or ReplyParsing())
        self._opened: list[str] = []  # the output items opened, in order: "reasoning", "message", "call:<i>"

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        body = self.shapes.body("in_progress", [], None)
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        """The events of what a delta adds (not what may still become a tool call's start)."""
        self._text += delta.text
        shown = delta.logprobs if self.shapes.parsing is None else None  # (parsed, text and tokens part ways)
        logprobs = chat_logprobs(self.shapes.info, shown)["content"] if shown else []
        return [e for event in self._stream.update(self._text) for e in self._on(event, logprobs)]

    def finish(self, choice: ChoiceOutput, usage: UsageCount) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The events that end the output items and the response, and the response's body."""
        last, parts = self._stream.finish(choice.text, choice.finish_reason)
        events = [e for event in last for e in self._on(event, [])]
        self.shapes.count_reasoning(choice, usage)
        keep = {"keep_message": "message" in self._opened, "keep_reasoning": "reasoning" in self._opened}
        status, output = self.shapes.reply(choice, parts, **keep)  # the reply parsed once
        calls = 0
        for index, item in enumerate(output):
            key = item["type"]
            if key == "function_call":
                key, calls = f"call:{calls}", calls + 1
            events += self._open(key, item) + self._close(index, item)
        body = self.shapes.body(status, output, usage)
        events.append(self.event(f"response.{status}", response=body))
        return events, body

    def failed(self, code: str, message: str) -> dict[str, Any]:
        body = self.shapes.body("failed", [], None, error={"code": code, "message": message})
        return self.event("response.failed", response=body)

    def _on(self, event: Event, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if isinstance(event, Reasoning):
            item = self.shapes.reasoning("", "in_progress")
            return self._open("reasoning", item) + [self._text_delta("reasoning", event.text, [])]
        if isinstance(event, Content):
            item = self.shapes.message("", "in_progress", None)
            return self._open("message", item) + [self._text_delta("message", event.text, logprobs)]
        if isinstance(event, CallStart):
            fc_id, call_id = self.shapes.call_ids(event.index)
            item = {"type": "function_call", "id": fc_id, "call_id": call_id, "name": event.name, "arguments": ""}
            return self._open(f"call:{event.index}", {**item, "status": "in_progress"})
        assert isinstance(event, Arguments)
        key = f"call:{event.index}"
        item_id = self.shapes.call_ids(event.index)[0]
        index = self._opened.index(key)
        return [
            self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=event.text)
        ]

    def _open(self, key: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        """An item's opening events, the first time it is seen."""
        if key in self._opened:
            return []
        self._opened.append(key)
        index = len(self._opened) - 1
        if item["type"] not in _TEXT_PARTS:
            return [self.event("response.output_item.added", output_index=index, item=item)]
        part = _empty_part(item["type"])
        return [
            self.event("response.output_item.added", output_index=index, item={**item, "content": []}),
            self.event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
            ),
        ]

    def _text_delta(self, key: str, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        index = self._opened.index(key)
        item_id = self.shapes.reasoning_id if key == "reasoning" else self.shapes.message_id
        fields = {"item_id": item_id, "output_index": index, "content_index": 0, "delta": text}
        if key == "reasoning":
            return self.event("response.reasoning_text.delta", **fields)
        return self.event("response.output_text.delta", **fields, logprobs=logprobs)

    def _close(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            done = self.event(
                "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
            )
            return [done, self.event("response.output_item.done", output_index=index, item=item)]
        part = item["content"][0]
        if item["type"] == "reasoning":
            done = self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
        else:
            done = self.event(
                "response.output_text.done", **where, content_index=0, text=part["text"], logprobs=part["logprobs"]
            )
        return [
            done,
            self.event("response.content_part.done", **where, content_index=0, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


def _empty_part(item_type: str) -> dict[str, Any]:
    if item_type == "reasoning":
        return {"type": "reasoning_text", "text": ""}
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
