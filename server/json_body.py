"""Request bodies -> JSON values, with bounds checked before and while parsing.

Python's `json` would turn some hostile bodies into exceptions it does not document as parse
errors: a body nested 60,000 deep raises RecursionError, an integer of 5,000 digits raises
ValueError (int-str conversion limit), `NaN` and `1e999` parse to floats the engine's float32
rows cannot hold, and `"\\ud800"` escapes make lone surrogates that no later encoder accepts.
Here each is a `JSONBodyError` (a 400 for the caller): the nesting depth is measured on the raw
text before parsing (strings removed first, so brackets inside them do not count), numbers are
parsed by bounded hooks, and every string of the result, keys included, must be valid Unicode.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from jaxserve.sampling_params import encodes_as_utf8

MAX_DEPTH = 32  # nesting of arrays and objects; the deepest request schema needs 4
MAX_NUMBER_CHARS = 40  # a 64-bit seed has 20 digits; floats rarely need more than 25 characters

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN = np.frombuffer(b"[{", np.uint8)
_CLOSE = np.frombuffer(b"]}", np.uint8)


class JSONBodyError(ValueError):
    """The body is not JSON that this server reads; the message says why."""


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets in strings not counted)."""
    structure = np.frombuffer(_STRING.sub(b"", raw), np.uint8)
    steps = np.isin(structure, _OPEN).astype(np.int32) - np.isin(structure, _CLOSE).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_NUMBER_CHARS:
        raise JSONBodyError(f"a number in the body has more than {MAX_NUMBER_CHARS} digits")
    return int(literal)


def _parse_float(literal: str) -> float:
    if len(literal) > MAX_NUMBER_CHARS:
        raise JSONBodyError(f"a number in the body has more than {MAX_NUMBER_CHARS} characters")
    value = float(literal)
    if not math.isfinite(value):
        raise JSONBodyError(f"the number {literal} is out of range")
    return value


def _refuse_constant(name: str) -> None:
    raise JSONBodyError(f"{name} is not valid JSON")


def _check_strings(value: Any) -> None:
    if isinstance(value, str):
        if not encodes_as_utf8(value):
            raise JSONBodyError("a string in the body is not valid Unicode (it holds a lone surrogate)")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key)
            _check_strings(item)
    elif isinstance(value, list):
        for item in value:
            _check_strings(item)


def parse_json(raw: bytes) -> Any:
    """The JSON value of a UTF-8 body, or JSONBodyError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JSONBodyError(f"the body is not valid UTF-8: {e}") from None
    if nesting_depth(raw) > MAX_DEPTH:
        raise JSONBodyError(f"the body is nested deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise JSONBodyError(str(e)) from None
    _check_strings(value)  # depth is bounded, so the recursion is too
    return value
