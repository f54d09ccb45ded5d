"""One reply of the Messages API, built from the engine's deltas: the events of its stream as they
come, and at the end the `message` object. A reply that is not streamed is built by the same code
(its events dropped), so a stream always accumulates to the message that was not streamed.

Events, in Anthropic's order: `message_start` (then a `ping`), per content block
`content_block_start`, `content_block_delta`... (`thinking_delta` for a thinking block,
`text_delta`, or `input_json_delta` for a tool_use block), `content_block_stop`; then
`message_delta` (stop_reason, stop_sequence, usage) and `message_stop`.

With tools or a reasoning parser, `server.reply_stream.ReplyStream` reads the reply as it grows:
its reasoning becomes a thinking block (as vLLM and SGLang give it: with an empty `signature`), its
text up to where a call starts a text block, and each call a tool_use block once its name is
complete, its input streamed fragment by fragment (in the form the finished reply's parse gives). A stop sequence
reaches here at the end of the text (the engine keeps it: `include_stop_str_in_output`), which tells
it from an end of turn; it is cut off and named in `stop_sequence`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from jaxserve.outputs import Delta
from server.openai_bodies import UsageCount
from server.reply_stream import ReplyParsing
from server.tool_stream import Arguments, CallStart, Content, Reasoning
from server.tool_stream import Event as ReplyEvent

Event = dict[str, Any]
_EMPTY_BLOCKS = {
    "text": lambda: {"type": "text", "text": ""},
    "thinking": lambda: {"type": "thinking", "thinking": "", "signature": ""},
}


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
        parsing: ReplyParsing | None,
        stop_sequences: list[str],
        parallel: bool = True,
    ) -> None:
        self.id = message_id
        self.model = model
        self._parts = parsing.stream() if parsing is not None else None
        self._stops = stop_sequences
        self._parallel = parallel  # False: only the first call of a reply is kept
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the block being streamed
        self._call_blocks: dict[int, int] = {}  # call index -> its tool_use block's index
        self._inputs: dict[int, str] = {}  # tool_use block index -> its input as written so far
        self.text = ""  # the whole text of the reply so far (stop sequence cut)
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def start(self, prompt_tokens: int) -> list[Event]:
        usage = UsageCount(prompt_tokens=prompt_tokens)
        head = {**self._envelope(usage), "content": [], "stop_reason": None, "stop_sequence": None}
        return [{"type": "message_start", "message": head}, {"type": "ping"}]

    def delta(self, delta: Delta, streaming: bool = True) -> list[Event]:
        """The events that show a delta (none while a tool call or a tag may be starting in the
        text). Not `streaming`, a reply with tools or reasoning only gathers its text: `finish`
        parses it once."""
        text = delta.text
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            text = self._cut_stop_sequence(text)
        self.text += text
        if self._parts is None:
            return self._text_delta("text", text) if text else []
        return self._show(self._parts.update(self.text)) if streaming else []

    def finish(self, usage: UsageCount) -> list[Event]:
        """The events that end the reply: the rest of its text and calls, the stop reason and usage."""
        events: list[Event] = []
        if self._parts is not None:
            more, _ = self._parts.finish(self.text, self.finish_reason)
            events += self._show(more)
        events += self._close()
        for index, arguments in self._inputs.items():
            self.blocks[index]["input"] = _tool_input(arguments)
        self.stop_reason = self._stop_reason(bool(self._inputs))
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

    def _show(self, events: list[ReplyEvent]) -> list[Event]:
        """Anthropic's events for the reply stream's: thinking, text, a call started, more of its input."""
        out: list[Event] = []
        for event in events:
            if isinstance(event, Reasoning | Content):
                kind = "thinking" if isinstance(event, Reasoning) else "text"
                out += self._text_delta(kind, event.text) if event.text else []
            elif isinstance(event, CallStart):
                if self._parallel or event.index == 0:
                    block = {"type": "tool_use", "id": _tool_use_id(), "name": event.name, "input": {}}
                    out += self._open_block(block)
                    self._call_blocks[event.index] = len(self.blocks) - 1
                    self._inputs[len(self.blocks) - 1] = ""
            elif isinstance(event, Arguments) and event.index in self._call_blocks:
                index = self._call_blocks[event.index]
                self._inputs[index] += event.text
                delta = {"type": "input_json_delta", "partial_json": event.text}
                out.append({"type": "content_block_delta", "index": index, "delta": delta})
        return out

    def _open_block(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self._open = block
        self.blocks.append(block)
        start = dict(block)
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _text_delta(self, kind: str, text: str) -> list[Event]:
        """More text of a text block, or (`kind` "thinking") of a thinking block."""
        opened = self._open is not None and self._open["type"] == kind
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        events = [] if opened else self._open_block(block)
        self._open[kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]
