"""What a reply is made of (reasoning, content, tool calls), whole and as it streams.

`ReplyParsing` is one request's setup: its reasoning parser (`server.reasoning`) and its tools
(`server.tools`), either of them absent. The reasoning parser reads the reply first; the content
after the reasoning is what the tool-call parser reads. A harmony reply (gpt-oss's) says itself
which part is which, and `server.harmony` reads it instead. `parts` splits a finished reply;
`stream` gives one choice's `ReplyStream`, which turns the reply so far into events (reasoning,
content, a call's start, its arguments) whose concatenation is what `parts` gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from server import harmony
from server.reasoning import ReasoningParser, ReasoningStream
from server.tool_stream import Event, Reasoning, ToolStream
from server.tools import ToolCall, ToolCalling

if TYPE_CHECKING:
    from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ReplyParts:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class ReplyParsing:
    tools: ToolCalling | None = None
    reasoning: ReasoningParser | None = None
    harmony: bool = False  # the reply is harmony (detokenized with its special tokens)

    @property
    def reads_reasoning(self) -> bool:
        """Whether replies are read for reasoning (a reasoning parser, or harmony's channels)."""
        return self.harmony or self.reasoning is not None

    def parts(self, text: str, finish_reason: str | None) -> ReplyParts:
        """The parts of a finished reply (as `ToolCalling.reply` reports calls and finish reasons)."""
        return self.stream().finish(text, finish_reason)[1]

    def stream(self) -> ReplyStream:
        return ReplyStream(self)

    def reasoning_tokens(self, tokenizer: Tokenizer, token_ids: Sequence[int]) -> int:
        if self.harmony:
            return harmony.reasoning_tokens(tokenizer, token_ids, calls=self.tools is not None)
        return 0 if self.reasoning is None else self.reasoning.reasoning_tokens(tokenizer, token_ids)


class ReplyStream:
    """One choice's reply, turned into events as it grows (each delta read once: `server.reasoning.
    ReasoningStream`, `server.tool_stream.ToolStream`)."""

    def __init__(self, parsing: ReplyParsing) -> None:
        self._parser = parsing.reasoning
        self._reasoning = ReasoningStream(parsing.reasoning) if parsing.reasoning is not None else None
        self._harmony = harmony.HarmonyStream(parsing.tools is not None) if parsing.harmony else None
        self.tools = ToolStream(parsing.tools)

    def update(self, text: str) -> list[Event]:
        """The events that the reply so far (`text`, all of it, grown from the last call) adds."""
        if self._harmony is not None:
            return self._harmony.update(text)
        if self._reasoning is None:
            return self.tools.update(text)
        piece = self._reasoning.update(text)
        events: list[Event] = [Reasoning(piece)] if piece else []
        start = self._reasoning.content_start
        if start is not None and start < len(text):
            events += self.tools.update(text, start)
        return events

    def finish(self, text: str, finish_reason: str | None) -> tuple[list[Event], ReplyParts]:
        """The last events of the finished reply `text`, and its parts."""
        if self._harmony is not None:
            events, reasoning, reply = self._harmony.finish(text, finish_reason)
            return events, ReplyParts(reasoning, reply.content, reply.calls, reply.finish_reason)
        reasoning, content = None, text
        events: list[Event] = []
        if self._parser is not None:
            split = self._parser.split(text)
            sent = self._reasoning.sent
            events = [Reasoning(split.reasoning[sent:])] if len(split.reasoning) > sent else []
            reasoning, content = split.reasoning or None, split.content
        more, reply = self.tools.finish(content, finish_reason)
        return events + more, ReplyParts(reasoning, reply.content, reply.calls, reply.finish_reason)
