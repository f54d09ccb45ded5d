"""A reply's tool calls streamed as they are written: each call's name once it is complete, then
its arguments fragment by fragment, as OpenAI streams them.

`ToolStream` reads one choice's content (the reply after any reasoning) each time it grows. It
shows the text before the first call as content (less its trailing whitespace, which a reply with
calls drops; nothing of a forced reply), and for each call whose name is complete, a `CallStart`
and then `Arguments` fragments: the arguments rewritten by
`StableJson` into the form the non-streamed reply gives, so the fragments join into exactly the
`arguments` of the same reply not streamed. At the end, `finish` sends what is left of each call
as the whole reply's parse has it (`ToolCalling.reply`).

It reads each delta once, not the whole reply again: the text before a call is searched for a
call's start only where it grew (once the reply's start has ruled out a call there), each call's
arguments are rewritten from where they stopped, and with formats whose calls parse alone (Hermes,
Qwen3-Coder) only the call being written is parsed again. (Llama 3, Mistral, pythonic and
"required" calls are parsed again from the first call at each delta: a cost that grows with the
calls, not with the text before them.)
"""

from __future__ import annotations

import dataclasses

from server.partial_json import StableJson
from server.tools import PartialCall, ToolCall, ToolCalling


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
        self._base = 0  # where the content starts in the reply's text
        self._shown = 0  # the end of the content sent (in the reply's text)
        self._open_start = True  # a call may still start at the content's start
        self._scanned = 0  # no call marker starts before this
        self._calls_at: int | None = None  # where the calls not yet complete start, once a call has
        self._calls_before = 0  # the (complete) calls before `_calls_at`
        self._arguments: list[ArgumentsStream] = []  # per call started
        self._following: int | None = None  # the call whose arguments are read straight from the text

    def update(self, text: str, base: int = 0) -> list[Event]:
        """The events that the content adds: `text[base:]`, the whole content so far (`text` the
        whole reply, grown from the last call; `base` the same at every call)."""
        self._base, self._shown = base, max(self._shown, base)
        if self._tools is None:
            return self._content(text, len(text))
        events = self._follow(text) if self._following is not None else []
        if self._following is not None:
            return events  # still inside the arguments of the last call
        if self._tools.forced:
            return events + self._calls(self._tools.partial_calls(text if base == 0 else text[base:]), 0, text)
        events += self._content(text, self._content_end(text)) if self._calls_at is None else []
        if self._calls_at is None:
            return events
        calls = self._tools.format.partial_calls(text[self._calls_at :])
        events += self._calls(calls, self._calls_before, text)
        separator = self._tools.format.call_separator
        if separator is not None and len(calls) > 1 and len(self._arguments) >= self._calls_before + len(calls):
            self._calls_before += len(calls) - 1  # all but the last are complete: parse from the last
            self._calls_at = text.rfind(separator, self._calls_at)
        return events

    def finish(self, text: str, finish_reason: str | None) -> tuple[list[Event], ToolReply]:
        """The last events of the content `text` (whole), and the reply as not streamed."""
        shown = self._shown - self._base
        if self._tools is None:
            return _rest(text, shown), ToolReply(text, [], finish_reason)
        content, calls, finish_reason = self._tools.reply(text, finish_reason)
        events = _rest(content or "", shown)
        for index, call in enumerate(calls):
            if index == len(self._arguments):
                events.append(CallStart(index, call.name))
                self._arguments.append(ArgumentsStream())
            events += self._arguments[index].rest(index, call.arguments)
        return events, ToolReply(content, calls, finish_reason)

    def _content(self, text: str, end: int) -> list[Event]:
        if end <= self._shown:
            return []
        piece, self._shown = text[self._shown : end], end
        return [Content(piece)]

    def _content_end(self, text: str) -> int:
        """How far the content may be shown: everything before a call (or before what may still
        become one), less its trailing whitespace; sets `_calls_at` when a call starts."""
        fmt = self._tools.format
        if self._open_start:  # the content is short until its start rules a call in or out
            content = text[self._base :]
            start = fmt.call_start(content)
            held = fmt.holdback(content)
            if start is not None:
                self._calls_at = self._base + start
            elif held == 0 and content.strip():
                self._open_start = False
                self._scanned = max(self._base, len(text) - max(map(len, fmt.markers_anywhere), default=1) + 1)
            end = self._base + (start if start is not None else len(content) - held)
        else:
            end = self._marker_search(text, fmt.markers_anywhere)
        while end > self._shown and text[end - 1].isspace():
            end -= 1  # a reply with calls drops the whitespace before them
        return end

    def _marker_search(self, text: str, markers: tuple[str, ...]) -> int:
        """The content's end as far as what is new shows it: a call's start, or the text less what
        may still become one."""
        found = [at for at in (text.find(m, self._scanned) for m in markers) if at >= 0]
        if found:
            self._calls_at = min(found)
            return self._calls_at
        longest = max(map(len, markers), default=1)
        self._scanned = max(self._scanned, len(text) - longest + 1)
        for k in range(min(longest - 1, len(text) - self._base), 0, -1):
            if any(text.endswith(m[:k]) for m in markers):
                return len(text) - k
        return len(text)

    def _calls(self, calls: list[PartialCall], first: int, text: str) -> list[Event]:
        """The events of the calls `calls` (numbered from `first`) as far as they are written. When
        the last one's arguments are JSON cut by the end of `text`, they are read from the text
        from then on (`_follow`) until they close, without parsing the calls again."""
        events: list[Event] = []
        for index, (name, raw) in enumerate(calls, start=first):
            if name is None:
                break  # calls start in order: a later one waits for this one's name
            if index == len(self._arguments):
                events.append(CallStart(index, name))
                self._arguments.append(ArgumentsStream())
            events += self._arguments[index].more(index, raw)
            if index == first + len(calls) - 1 and self._arguments[index].follows(raw, text):
                self._following = index
        return events

    def _follow(self, text: str) -> list[Event]:
        """More of the arguments being read straight from the text; stops following once they close."""
        index = self._following
        arguments = self._arguments[index]
        events = arguments.more_of(index, text)
        if arguments.done:
            self._following = None
        return events


class ArgumentsStream:
    """A call's arguments as sent: their stable form, read as the raw text grows."""

    def __init__(self) -> None:
        self._form = StableJson()
        self._head = ""  # the raw text's start, and its length so far: what shows it only grew
        self._length = 0
        self.sent: list[str] = []

    def more(self, index: int, raw: str) -> list[Event]:
        """The fragment that `raw` (the arguments' whole text so far) adds; nothing more once the
        text changed rather than grew (only a reply whose call stops parsing could do that)."""
        if len(raw) < self._length or not raw.startswith(self._head):
            self._form.done = True
        self._head, self._length = raw[:_HEAD], len(raw)
        piece = self._form.more(raw)
        if not piece:
            return []
        self.sent.append(piece)
        return [Arguments(index, piece)]

    @property
    def done(self) -> bool:
        return self._form.done

    def follows(self, raw: str, text: str) -> bool:
        """Whether the arguments, whose text so far is `raw`, go on in `text` from here: they are
        still open and `raw` is the end of `text` (then `more_of` reads them from `text`)."""
        if self._form.done or not raw or not text.endswith(raw):
            return False
        self._form.move(len(text) - len(raw))
        return True

    def more_of(self, index: int, text: str) -> list[Event]:
        """The fragment that `text` (the reply, the arguments in it as `follows` found them) adds."""
        piece = self._form.more(text)
        if not piece:
            return []
        self.sent.append(piece)
        return [Arguments(index, piece)]

    def rest(self, index: int, arguments: str) -> list[Event]:
        """The part of the finished call's `arguments` not sent (nothing when they do not extend
        what was sent)."""
        sent = "".join(self.sent)
        if len(arguments) <= len(sent) or not arguments.startswith(sent):
            return []
        self.sent.append(arguments[len(sent) :])
        return [Arguments(index, self.sent[-1])]


_HEAD = 16


def _rest(text: str, shown: int) -> list[Event]:
    """The content `text` past what was sent."""
    return [Content(text[shown:])] if len(text) > shown else []
