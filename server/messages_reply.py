"""One reply of the Messages API, built from the engine's deltas: the events of its stream as they
come, and at the end the `message` object. A reply that is not streamed is built by the same code
(its events dropped), so a stream always accumulates to the message that was not streamed.

Events, in Anthropic's order: `message_start` (then a `ping`), per content block
`content_block_start`, `content_block_delta`... (`text_delta`, or `input_json_delta` for a tool_use
block), `content_block_stop`; then `message_delta` (stop_reason, stop_sequence, usage) and
`message_stop`.

With tools, the text is shown up to where a tool call starts (or may still start: `ToolCalling.shown`),
without leading or trailing whitespace around it; the calls become tool_use blocks at the end. A
reply forced to one named tool is that tool's input as it is written, streamed argument by argument.
A stop sequence reaches here at the end of the text (the engine keeps it: `include_stop_str_in_output`),
which tells it from an end of turn; it is cut off and named in `stop_sequence`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from jaxserve.outputs import Delta
from server.openai_bodies import UsageCount
from server.tools import ToolCall, ToolCalling

Event = dict[str, Any]


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object; {} for arguments cut short (by max_tokens) or not an object."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageReply:
    def __init__(
        self,
        message_id: str,
        model: str,
        tools: ToolCalling | None,
        stop_sequences: list[str],
        parallel: bool = True,
    ) -> None:
        self.id = message_id
        self.model = model
        self._tools = tools
        self._named = tools is not None and tools.choice.mode == "function"
        self._stops = stop_sequences
        self._parallel = parallel
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the block being streamed
        self._json = ""  # the open tool_use block's input as written so far
        self.text = ""  # the whole text of the reply so far (stop sequence cut)
        self._sent = 0  # with tools: where the text shown so far ends in `text`
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def start(self, prompt_tokens: int) -> list[Event]:
        usage = UsageCount(prompt_tokens=prompt_tokens)
        head = {**self._envelope(usage), "content": [], "stop_reason": None, "stop_sequence": None}
        return [{"type": "message_start", "message": head}, {"type": "ping"}]

    def delta(self, delta: Delta) -> list[Event]:
        """The events that show a delta (none while a tool call may be in the text)."""
        text = delta.text
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            text = self._cut_stop_sequence(text)
        self.text += text
        if self._tools is None:
            return self._text_delta(text) if text else []
        if self._named:
            return self._json_delta(text)
        if self._tools.forced:
            return []  # a reply forced to call any tool is a list of calls: shown whole at the end
        lead = len(self.text) - len(self.text.lstrip())
        end = len(self.text[: self._tools.shown(self.text)].rstrip())
        start = max(self._sent, lead)
        if end <= start:
            return []
        self._sent = end
        return self._text_delta(self.text[start:end])

    def finish(self, usage: UsageCount) -> list[Event]:
        """The events that end the reply: the rest of its text, its tool_use blocks, the stop reason
        and usage."""
        events: list[Event] = []
        calls: list[ToolCall] = []
        if self._named:
            if self._open is None:
                events += self._json_delta("")
            self._open["input"] = _tool_input(self._json)
        elif self._tools is not None:
            content, calls, _ = self._tools.reply(self.text, self.finish_reason)
            calls = calls if self._parallel else calls[:1]
            if not self._tools.forced:
                events += self._rest_of_text(content if calls else self.text.lstrip())
        events += self._close()
        for call in calls:
            events += self._whole_tool_use(call)
        self.stop_reason = self._stop_reason(bool(calls) or self._named)
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return events + [
            {"type": "message_delta", "delta": delta, "usage": self._usage(usage)},
            {"type": "message_stop"},
        ]

    def message(self, usage: UsageCount) -> dict[str, Any]:
        """The finished reply as one `message` object."""
        return {
            **self._envelope(usage),
            "content": self.blocks,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
        }

    def _envelope(self, usage: UsageCount) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "usage": self._usage(usage)}

    @staticmethod
    def _usage(usage: UsageCount) -> dict[str, int]:
        """Anthropic's usage: `input_tokens` are the prompt tokens not read from the (prefix) cache."""
        return {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
        }

    def _stop_reason(self, tool_use: bool) -> str:
        if self.finish_reason == "length":
            return "max_tokens"
        if self.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if tool_use else "end_turn"

    def _cut_stop_sequence(self, text: str) -> str:
        """The last delta's text without the stop sequence that ended the reply (the engine holds a
        possible stop sequence back until it is decided, so a whole one arrives in the last delta)."""
        if self.finish_reason != "stop":
            return text
        whole = self.text + text
        matched = [s for s in self._stops if whole.endswith(s)]
        if not matched:
            return text
        self.stop_sequence = max(matched, key=len)
        return whole[: len(whole) - len(self.stop_sequence)][len(self.text) :]

    def _open_block(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self._open = block
        self.blocks.append(block)
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _text_delta(self, text: str) -> list[Event]:
        events = [] if self._open is not None else self._open_block({"type": "text", "text": ""})
        self._open["text"] += text
        delta = {"type": "text_delta", "text": text}
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _json_delta(self, partial: str) -> list[Event]:
        """The input of the one tool_use block of a reply forced to a named tool, as written."""
        events: list[Event] = []
        if self._open is None:
            name = self._tools.choice.name
            events = self._open_block({"type": "tool_use", "id": _tool_use_id(), "name": name, "input": {}})
        self._json += partial
        if partial:
            delta = {"type": "input_json_delta", "partial_json": partial}
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        return events

    def _rest_of_text(self, final: str | None) -> list[Event]:
        """The part of the reply's final text not shown yet (what was shown is a prefix of it)."""
        shown = self._open["text"] if self._open is not None else ""
        final = final or ""
        if not final.startswith(shown) or len(final) == len(shown):
            return []
        return self._text_delta(final[len(shown) :])

    def _whole_tool_use(self, call: ToolCall) -> list[Event]:
        arguments = _tool_input(call.arguments)
        events = self._open_block({"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": arguments})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(arguments, ensure_ascii=False)}
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}] + self._close()
