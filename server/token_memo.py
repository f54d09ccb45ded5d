"""Remembers which token ids a session's text was sent to the engine as, to hit the prefix cache.

A session's next prompt is its rendered history plus the new message. Encoding that text from
scratch can tokenize the model's own earlier reply differently from the ids it generated (BPE
has several spellings of one text), and then the prefix cache misses from that point on. So
each generation records (text, ids): the prompt text with its ids, and the prompt text plus
the raw reply with the prompt ids plus the generated ids. A new prompt reuses the ids of the
longest recorded text it starts with and encodes only the rest.
"""

from __future__ import annotations

from typing import Any

from jaxserve.tokenizer import Tokenizer

MAX_ENTRIES = 4


class TokenMemo:
    def __init__(self, entries: list[tuple[str, list[int]]] | None = None) -> None:
        self._entries: list[tuple[str, list[int]]] = list(entries or [])  # most recent first

    def encode(self, tokenizer: Tokenizer, text: str) -> list[int]:
        best: tuple[str, list[int]] | None = None
        for entry in self._entries:
            if text.startswith(entry[0]) and (best is None or len(entry[0]) > len(best[0])):
                best = entry
        if best is None:
            return tokenizer.encode(text)
        rest = text[len(best[0]):]
        return best[1] + (tokenizer.encode(rest) if rest else [])

    def record(self, text: str, ids: list[int]) -> None:
        self._entries = [(text, list(ids))] + [e for e in self._entries if e[0] != text][: MAX_ENTRIES - 1]

    def copy(self) -> TokenMemo:
        return TokenMemo(self._entries)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"text": text, "ids": ids} for text, ids in self._entries]

    @classmethod
    def from_json(cls, data: list[dict[str, Any]]) -> TokenMemo:
        return cls([(str(e["text"]), [int(i) for i in e["ids"]]) for e in data])
