"""Reasoning parsers: a thinking model's `<think>...</think>` apart from its answer.

`--reasoning-parser` takes vLLM's names (and "openai_gptoss", gpt-oss's harmony channels, which
`server.harmony` reads: a harmony template's replies are read so with or without the flag):
- "deepseek_r1": the reply starts inside the think block (DeepSeek-R1's template opens it in the
  prompt); everything up to `</think>` is reasoning, and a reply that never closes it is all
  reasoning. A `<think>` the model writes itself at the start is dropped.
- "qwen3": the reply is reasoning when it starts with `<think>` (Qwen3 writes it), or when the
  prompt ends inside an open think block (templates that open it themselves, such as
  Qwen3-Thinking's); otherwise (`enable_thinking: false` writes an empty block into the prompt)
  it is all content.

The answer after `</think>` is the content (its leading whitespace dropped), which the tool-call
parser then reads: calls written inside the reasoning are reasoning, calls after it are calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (server.config imports this module for its names)
    from jaxserve.tokenizer import Tokenizer


REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
THINK_PARSERS = ("qwen3", "deepseek_r1")  # the ones this module reads
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 32  # the prompt's last tokens, read to see whether it leaves a think block open


@dataclasses.dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str
    content: str
    ended: bool  # the reasoning is over (the rest is content)


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """Splits one request's replies. `opened`: a reply starts inside a think block."""

    name: str
    opened: bool

    @classmethod
    def for_prompt(cls, name: str, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> ReasoningParser:
        """The parser of a request whose prompt is `prompt_ids` (does it leave a think block open?)."""
        if name not in THINK_PARSERS:
            raise ValueError(f"unknown think-block parser {name!r}; known: {list(THINK_PARSERS)}")
        tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        prompt_opens = tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)
        return cls(name, name == "deepseek_r1" or prompt_opens)

    def split(self, text: str) -> ReasoningSplit:
        """The reasoning and content of a finished reply (`ReasoningStream` reads one as it grows)."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            body = stripped[len(THINK_OPEN) :]
        elif self.opened:
            body = text
        else:
            return ReasoningSplit("", text, True)
        end = body.find(THINK_CLOSE)
        if end >= 0:
            return ReasoningSplit(body[:end], body[end + len(THINK_CLOSE) :].lstrip(), True)
        return ReasoningSplit(body, "", False)

    def reasoning_tokens(self, tokenizer: Tokenizer, token_ids: Sequence[int]) -> int:
        """Of a finished reply's tokens, how many are reasoning: those up to and including the
        ones that write `</think>` (all of them when it never comes; none without reasoning)."""
        text = tokenizer.decode(token_ids, skip_special_tokens=False)
        if not self.opened and not text.lstrip().startswith(THINK_OPEN):
            return 0
        if not self.split(text).ended:
            return len(token_ids)
        low, high = 1, len(token_ids)  # the shortest prefix whose text holds the closing tag
        while low < high:
            mid = (low + high) // 2
            if THINK_CLOSE in tokenizer.decode(token_ids[:mid], skip_special_tokens=False):
                high = mid
            else:
                low = mid + 1
        return low


class ReasoningStream:
    """`ReasoningParser.split` of a reply that grows, read once (what may still become a tag, the
    start of `</think>` or of a leading `<think>`, is kept back): `update(text)` (the whole reply
    so far, the last call's grown) gives the reasoning it adds and, once the reasoning is over,
    where the content starts in `text`. Only what is new is read: the `</think>` search goes on
    from where it stopped, so a long reasoning costs each delta the delta."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._body: int | None = None  # where the reasoning starts, once it is known there is one
        self._sent = 0  # the end of the reasoning sent
        self._searched = 0  # `</think>` is not before this
        self.content_start: int | None = None  # the answer's start, once the reasoning is over

    @property
    def sent(self) -> int:
        """How many characters of reasoning `update` gave."""
        return 0 if self._body is None else max(0, self._sent - self._body)

    def update(self, text: str) -> str:
        """The reasoning that `text` adds (`content_start` is set once the reasoning ends)."""
        if self.content_start is not None:
            return self._skip_space(text) if self._body is not None else ""
        if self._body is None and not self._decide(text):
            return ""
        end = text.find(THINK_CLOSE, self._searched)
        if end >= 0:
            self.content_start = end + len(THINK_CLOSE)
            self._skip_space(text)
        else:
            self._searched = max(self._body, len(text) - len(THINK_CLOSE) + 1)
            end = len(text) - min(_partial_tag(text, THINK_CLOSE), len(text) - self._body)
        piece = text[max(self._sent, self._body) : end]
        self._sent = max(self._sent, end)
        return piece

    def _decide(self, text: str) -> bool:
        """Find where the reasoning starts (as `split` does); False while the start may still be `<think>`."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._body = len(text) - len(stripped) + len(THINK_OPEN)
        elif THINK_OPEN.startswith(stripped):
            return False
        elif self._parser.opened:
            self._body = 0
        else:
            self.content_start = 0  # no reasoning: all of it is content, as written
            return False
        self._searched = self._body
        return True

    def _skip_space(self, text: str) -> str:
        """Move the content's start past the whitespace that begins it (`split` drops it)."""
        while self.content_start < len(text) and text[self.content_start].isspace():
            self.content_start += 1
        return ""


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` are the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
