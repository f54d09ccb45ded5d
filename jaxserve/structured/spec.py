"""What a request's output must match, checked once at construction (no model needed).

Kinds follow vLLM's guided-decoding extras and OpenAI's `response_format`:
- "json": a JSON schema (`guided_json`, `response_format` json_schema);
- "json_object": any JSON object (`response_format` json_object);
- "regex": a regular expression (`guided_regex`);
- "choice": one of a list of strings (`guided_choice`);
- "grammar": a Lark or GBNF grammar (`guided_grammar`).

JSON is generated with fixed separators (", " and ": ", as `json.dumps` writes them) and no
other whitespace: a small model given free whitespace can spend its whole budget on newlines.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema or grammar larger than this is refused (it is compiled per request)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class GuidedDecoding:
    """A constraint on the whole output. `value`: the schema (a dict, for "json"), the regex or
    grammar text, or the list of choices; unused for "json_object". Raises ValueError naming the
    problem when the library cannot compile it."""

    kind: str
    value: Any = None
    grammar: str = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided decoding kind must be one of {GUIDED_KINDS}, got {self.kind!r}")
        grammar = _grammar(self.kind, self.value)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(f"invalid {_NAMES[self.kind]}: {messages[0]}")
        object.__setattr__(self, "grammar", grammar)


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def _grammar(kind: str, value: Any) -> str:
    """The llguidance grammar text of a constraint (ValueError for a value of the wrong type)."""
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "json":
        if isinstance(value, bool):
            value = {} if value else {"not": {}}
        if not isinstance(value, dict):
            raise ValueError("a JSON schema must be an object")
        _check_size(json.dumps(value), "JSON schema")
        return llguidance.LLMatcher.grammar_from_json_schema(value, overrides=JSON_OPTIONS)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("a choice list must be a non-empty list of non-empty strings")
        _check_size(json.dumps(value), "choice list")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"a {_NAMES[kind]} must be a non-empty string")
    _check_size(value, _NAMES[kind])
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    try:
        lark = any_to_lark(value)  # GBNF (llama.cpp's) or Lark, as vLLM accepts both
    except Exception as e:  # noqa: BLE001 - the converter's own parse errors
        raise ValueError(f"invalid grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _check_size(text: str, name: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"the {name} is longer than {MAX_SPEC_CHARS} characters")
