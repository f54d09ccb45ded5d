"""gpt-oss's replies in its "harmony" format: reasoning, answer and tool calls as channels.

A harmony reply is a run of messages after the prompt's `<|start|>assistant`, each a header and a
body: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`.
The markers are special tokens, so the reply is detokenized with them kept
(`server.reply_setup.reply_parsing` asks for that). Each message's body goes where its header says:
- channel `analysis`: reasoning (`reasoning_content`, Responses' reasoning items, thinking blocks);
- a recipient (`to=functions.NAME`, in the header before or after the channel): a call of tool
  NAME whose arguments are the body (JSON; `<|constrain|>json` says so), when the request has tools;
- any other message (`final`, a `commentary` preamble): content.
A reply whose start is not a header (a model that does not write harmony) is all content.
`<|call|>` and `<|return|>` end the reply (gpt-oss's generation config lists them as its EOS
tokens, so they are not in the text); `<|end|>` ends one message and the next follows.

`HarmonyStream` reads a reply as it grows into the events of `server.tool_stream` (each delta read
once); `finish` gives the rest and the whole reply's parts, so the events join into the parts.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from server.tool_stream import ArgumentsStream, CallStart, Content, Event, Reasoning, ToolReply
from server.tools import ToolCall

if TYPE_CHECKING:
    from jaxserve.tokenizer import Tokenizer

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_LONGEST_MARKER = max(len(m) for m in (START, CHANNEL, MESSAGE, *MESSAGE_ENDS))
_HEADER_STARTS = (START, CHANNEL, " to=")  # a reply's first header may name its recipient first
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


def is_harmony_template(template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's): its replies are read as channels."""
    return template is not None and CHANNEL in template and MESSAGE in template


@dataclasses.dataclass(frozen=True)
class Header:
    """A message's header: `<|channel|>NAME`, and `to=RECIPIENT` before or after it."""

    channel: str | None
    recipient: str | None

    @classmethod
    def read(cls, text: str) -> Header:
        channel, recipient = _CHANNEL_NAME.search(text), _RECIPIENT.search(text)
        return cls(channel and channel.group(1), recipient and recipient.group(1))

    def kind(self, calls: bool) -> str:
        """What the message's body is: "reasoning", "call" (when the request has tools) or "content"."""
        if self.recipient is not None and calls:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"

    @property
    def tool_name(self) -> str:
        return self.recipient.removeprefix(FUNCTIONS)


class HarmonyStream:
    """One choice's harmony reply, turned into events as it grows (each delta read once).
    `calls`: the request has tools (a message to a recipient is a call)."""

    def __init__(self, calls: bool) -> None:
        self._calls = calls
        self._at = 0  # where the message being read starts: its header, then (once read) its body
        self._header: Header | None = None  # of the message being read, once complete
        self._searched = 0  # no marker that `_at`'s message waits for starts before this
        self._plain = False  # the reply is not harmony: everything from `_sent` on is content
        self._sent = 0  # the end of what was sent of the body being read
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._call_list: list[_Call] = []

    def update(self, text: str) -> list[Event]:
        """The events that the reply so far (`text`, all of it, grown from the last call) adds."""
        events: list[Event] = []
        while True:
            if self._plain:
                return events + self._send(text, len(text), "content")
            if self._header is None:
                started = self._read_header(text)
                if started is None:
                    return events
                events += started
            kind = self._header.kind(self._calls)
            end, marker = self._message_end(text)
            if end is None:  # the body goes on: send all but what may still become a marker
                return events + self._send(text, len(text) - _partial_marker(text, self._sent), kind)
            events += self._send(text, end, kind)
            self._at = self._searched = end + len(marker)
            self._header = None

    def finish(self, text: str, finish_reason: str | None) -> tuple[list[Event], str | None, ToolReply]:
        """The last events of the finished reply `text`, its reasoning, and its content and calls
        (the finish reason "tool_calls" for a reply with calls that stopped). A message cut short
        (by length, a stop string) counts as far as it goes; a header cut short is dropped."""
        events = self.update(text)
        if self._header is not None:
            events += self._send(text, len(text), self._header.kind(self._calls))
        calls = [ToolCall(call.name, _arguments(call.body)) for call in self._call_list]
        for index, (call, read) in enumerate(zip(calls, self._call_list)):
            events += read.arguments.rest(index, call.arguments)
        content = "".join(self._content)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        reply = ToolReply(content or (None if calls else ""), calls, finish_reason)
        return events, "".join(self._reasoning) or None, reply

    def _read_header(self, text: str) -> list[Event] | None:
        """Read the header of the message at `_at`: None while it is not complete, else the events
        it starts (a call's). A reply, or what follows a message, that does not start as a header
        is plain content from there."""
        rest = text[self._at : self._at + len(CHANNEL)]
        if not rest.startswith(_HEADER_STARTS):
            if not any(start.startswith(rest) for start in _HEADER_STARTS):
                self._plain, self._sent = True, self._at
            return None
        body = text.find(MESSAGE, self._searched)
        if body < 0:
            self._searched = max(self._at, len(text) - len(MESSAGE) + 1)
            return None
        self._header = Header.read(text[self._at : body])
        self._at = self._sent = self._searched = body + len(MESSAGE)
        if self._header.kind(self._calls) != "call":
            return []
        self._call_list.append(_Call(self._header.tool_name))
        return [CallStart(len(self._call_list) - 1, self._header.tool_name)]

    def _message_end(self, text: str) -> tuple[int | None, str]:
        """Where the body being read ends, and the marker that ends it (None: not yet)."""
        found = [(at, m) for m in MESSAGE_ENDS if (at := text.find(m, self._searched)) >= 0]
        if found:
            return min(found)
        self._searched = max(self._at, len(text) - _LONGEST_MARKER + 1)
        return None, ""

    def _send(self, text: str, end: int, kind: str) -> list[Event]:
        """The body being read from what was sent up to `end`, as `kind`'s events."""
        if end <= self._sent:
            return []
        piece, self._sent = text[self._sent : end], end
        if kind == "reasoning":
            self._reasoning.append(piece)
            return [Reasoning(piece)]
        if kind == "content":
            self._content.append(piece)
            return [Content(piece)]
        call = self._call_list[-1]
        call.body = text[self._at : end]
        return call.arguments.more(len(self._call_list) - 1, call.body)


@dataclasses.dataclass
class _Call:
    name: str
    body: str = ""  # the arguments as written so far
    arguments: ArgumentsStream = dataclasses.field(default_factory=ArgumentsStream)


def _arguments(body: str) -> str:
    """A call's arguments as the other formats give them (`json.dumps` of the object); a body
    that is not a JSON object is given as written."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else body.strip()


def _partial_marker(text: str, start: int) -> int:
    """How many characters at the end of `text` (not before `start`) may still become a marker."""
    markers = (START, CHANNEL, MESSAGE, *MESSAGE_ENDS)
    for k in range(min(_LONGEST_MARKER - 1, len(text) - start), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


def reasoning_tokens(tokenizer: Tokenizer, token_ids: Sequence[int], calls: bool) -> int:
    """Of a finished harmony reply's tokens, how many are reasoning: those of its analysis
    messages (header, body and end marker)."""
    count, header, in_body, reasoning, message_tokens = 0, "", False, False, 0
    for token in token_ids:
        piece = tokenizer.decode([token], skip_special_tokens=False)
        message_tokens += 1
        if not in_body:
            if piece == MESSAGE:
                in_body, reasoning = True, Header.read(header).kind(calls) == "reasoning"
            else:
                header += piece
        elif piece in MESSAGE_ENDS:
            count += message_tokens if reasoning else 0
            header, in_body, message_tokens = "", False, 0
    return count + (message_tokens if in_body and reasoning else 0)
