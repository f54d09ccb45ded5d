"""A reply's tool calls streamed as they are written: each call's name once it is complete, then
its arguments fragment by fragment, as OpenAI streams them.

`ToolStream` reads one choice's content (the reply after any reasoning) each time it grows. It
shows the text before the first call as content (`ToolCalling.shown`), and for each call whose
name is complete, a `CallStart` and then `Arguments` fragments: the arguments rewritten by
`stable_json` into the form the non-streamed reply gives, so the fragments join into exactly the
`arguments` of the same reply not streamed. At the end, `finish` sends what is left of each call
as the whole reply's parse has it (`ToolCalling.reply`).
"""

from __future__ import annotations

import dataclasses

from server.partial_json import stable_json
from server.tools import ToolCall, ToolCalling


@dataclasses.dataclass(frozen=True)
class Reasoning:
    text: str


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclasses.dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Reasoning | Content | CallStart | Arguments


@dataclasses.dataclass(frozen=True)
class ToolReply:
    content: str | None
    calls: list[ToolCall]
    finish_reason: str | None


class ToolStream:
    """One choice's content and calls, sent as they grow."""

    def __init__(self, tools: ToolCalling | None) -> None:
        self._tools = tools
        self._shown = 0  # characters of the content sent
        self._arguments: list[str] = []  # per call started: its arguments sent

    def update(self, text: str) -> list[Event]:
        """The events that the content `text` (the whole content so far) adds."""
        if self._tools is None:
            return self._content(text, len(text))
        events = self._content(text, max(self._shown, self._tools.shown(text)))
        for index, (name, raw) in enumerate(self._tools.partial_calls(text)):
            if name is None:
                break  # calls start in order: a later one waits for this one's name
            if index == len(self._arguments):
                events.append(CallStart(index, name))
                self._arguments.append("")
            events += self._more_arguments(index, stable_json(raw))
        return events

    def finish(self, text: str, finish_reason: str | None) -> tuple[list[Event], ToolReply]:
        """The last events of the content `text` (whole), and the reply as not streamed."""
        if self._tools is None:
            return self._content(text, len(text)), ToolReply(text, [], finish_reason)
        content, calls, finish_reason = self._tools.reply(text, finish_reason)
        events = self._content(content or "", len(content or ""))
        for index, call in enumerate(calls):
            if index == len(self._arguments):
                events.append(CallStart(index, call.name))
                self._arguments.append("")
            events += self._more_arguments(index, call.arguments)
        return events, ToolReply(content, calls, finish_reason)

    def _content(self, text: str, end: int) -> list[Event]:
        if end <= self._shown:
            return []
        piece, self._shown = text[self._shown : end], end
        return [Content(piece)]

    def _more_arguments(self, index: int, arguments: str) -> list[Event]:
        """The part of `arguments` not sent yet (nothing when it does not extend what was sent:
        only a reply whose calls stop parsing at the end could do that)."""
        sent = self._arguments[index]
        if len(arguments) <= len(sent) or not arguments.startswith(sent):
            return []
        self._arguments[index] = arguments
        return [Arguments(index, arguments[len(sent) :])]
