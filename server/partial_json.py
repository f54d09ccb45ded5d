"""JSON text that is still being written: its objects as far as they go, and its stable normal form.

A streamed tool call's arguments are sent as they are generated, and the client joins the
fragments. The joined text must equal what the non-streamed reply gives: the arguments object
written by `json.dumps(value, ensure_ascii=False)` (", " and ": " separators, strings escaped
the same way whatever the model wrote). `stable_json` rewrites a prefix of the model's JSON into
that form, up to the last point that more text cannot change: a string as far as its complete
escapes go, a number or literal once something follows it.
"""

from __future__ import annotations

import json
import re

_SPACE = " \t\r\n"
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: runs of plain characters
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # the rest of a string, its closing quote too
# The part of a cut string whose escapes are whole.
_COMPLETE_CHARACTERS = re.compile(r'[^"\\]*(?:(?:\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})[^"\\]*)*')
_TOKEN_END = _SPACE + ",:}]"


def stable_json(raw: str) -> str:
    """The `json.dumps(..., ensure_ascii=False)` text of the JSON value that `raw` starts,
    as far as `raw` fixes it: every later, longer `raw` gives a text that starts with this one,
    and a complete value gives exactly `json.dumps(json.loads(value), ensure_ascii=False)`."""
    return StableJson().more(raw)


class StableJson:
    """`stable_json` of a text that grows, read once: each `more(raw)`, where `raw` is the whole
    text so far (the last call's grown), returns what its stable form gained, reading only what
    is new (a long string argument costs each delta the delta, not the string). Text that is not
    JSON ends what is read (a raw control character in a string, a bad literal)."""

    def __init__(self) -> None:
        self._at = 0  # where reading goes on in `raw`
        self._depth = 0
        self._in_string = False  # `_at` is inside a string (after its opening quote)
        self.done = False  # the value is complete, or cannot be read further

    def move(self, offset: int) -> None:
        """Read on from a text in which what was read so far starts at `offset` (the reply that
        holds the value, rather than the value's own text)."""
        self._at += offset

    def more(self, raw: str) -> str:
        out: list[str] = []
        while not self.done and self._at < len(raw):
            if self._in_string:
                if not self._string(raw, out):
                    break
            elif not self._token(raw, out):
                break
        return "".join(out)

    def _token(self, raw: str, out: list[str]) -> bool:
        """Read the token at `_at`; False when it may still go on (a number or literal at the end)."""
        c = raw[self._at]
        if c in _SPACE:
            self._at += 1
            return True
        if c in "{[":
            out.append(c)
            self._depth += 1
        elif c in "}]":
            out.append(c)
            self._depth -= 1
        elif c in ",:":
            out.append(c + " ")
        elif c == '"':
            out.append(c)
            self._at, self._in_string = self._at + 1, True
            return True
        else:
            end = self._at
            while end < len(raw) and raw[end] not in _TOKEN_END:
                end += 1
            if end == len(raw):
                return False
            try:
                out.append(json.dumps(json.loads(raw[self._at : end])))
            except json.JSONDecodeError:
                self.done = True
                return False
            self._at = end - 1
        self._at += 1
        self.done = self._depth <= 0  # a top-level scalar or a closed object is the whole value
        return True

    def _string(self, raw: str, out: list[str]) -> bool:
        """Read the string `_at` is in as far as its characters are complete; True once it closed."""
        whole = _STRING_REST.match(raw, self._at)
        end = whole.end() - 1 if whole is not None else _COMPLETE_CHARACTERS.match(raw, self._at).end()
        piece = raw[self._at : end]
        try:
            text = json.loads('"' + piece + '"')
        except json.JSONDecodeError:
            self.done = True
            return False
        if whole is None and text and "\ud800" <= text[-1] <= "\udbff":
            text, end = text[:-1], end - 6  # half of a surrogate pair: the other half decides the character
        out.append(json.dumps(text, ensure_ascii=False)[1:-1])
        self._at = end
        if whole is None:
            return False
        out.append('"')
        self._at, self._in_string = end + 1, False
        self.done = self._depth <= 0
        return True


def _string_end(raw: str, at: int) -> int | None:
    """The index after the string that opens at `at`, or None when it is cut."""
    match = _STRING.match(raw, at)
    return None if match is None else match.end()


def cut_objects(text: str, at: int, separators: str = " \t\r\n,") -> list[dict[str, str]]:
    """The JSON objects that follow `at` (separated by `separators`), their text ending anywhere:
    for each object, its keys and the raw text of their values as far as it goes (a key whose own
    text is cut is left out). Stops at anything that is not an object."""
    objects: list[dict[str, str]] = []
    while True:
        at = _skip(text, at, separators)
        if at >= len(text) or text[at] != "{":
            return objects
        item: dict[str, str] = {}
        objects.append(item)
        at += 1
        while True:
            at = _skip(text, at, " \t\r\n,")
            if at >= len(text):
                return objects
            if text[at] == "}":
                at += 1
                break
            key_end = _value_end(text, at)
            try:
                key = json.loads(text[at:key_end])
            except json.JSONDecodeError:
                return objects
            at = _skip(text, key_end, " \t\r\n:")
            end = _value_end(text, at)
            item[str(key)] = text[at:end]
            at = end


def cut_json_objects(text: str) -> list[dict[str, str]]:
    """The objects of a JSON array of objects whose text may end anywhere (see `cut_objects`)."""
    at = text.find("[")
    return [] if at < 0 else cut_objects(text, at + 1)


def complete_string(raw: str) -> str | None:
    """The value of a JSON string whose text is complete, else None."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _value_end(text: str, at: int) -> int:
    """Where the JSON value starting at `at` ends (`len(text)` when it is cut)."""
    depth, i = 0, at
    while i < len(text):
        c = text[i]
        if c == '"':  # strings are skipped whole (a regex: long arguments are read once per delta)
            end = _string_end(text, i)
            if end is None:
                return len(text)
            if depth == 0:
                return end
            i = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                return i
            depth -= 1
            if depth == 0:
                return i + 1
        elif c in ",:" and depth == 0:
            return i
        i += 1
    return len(text)
