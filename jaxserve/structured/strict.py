"""Strict JSON schemas: objects hold only the properties their schema lists, unless it says otherwise.

Plain JSON Schema lets an object carry any property it does not list (`additionalProperties`
defaults to true), and a grammar compiled from such a schema lets a model write them: a small
model asked for `get_weather(city)` goes on with `"description": ..., "temperature": ...` until
it runs out of tokens. OpenAI's strict function calling and xgrammar's default (vLLM's, SGLang's)
forbid them, and so does `strict_schema`: every object schema that says nothing of
`additionalProperties` gets `false`, at every depth (properties, items, `$defs`, `anyOf`, ...).
A schema that allows extras (`additionalProperties: true` or a schema) keeps them. Declared
properties never repeat in llguidance's grammar, so a strict object has no duplicate keys.

The branches of an `allOf` are left open at their top level: each lists only part of the
object's properties, and closing each would forbid the others' (their own nested objects are
still closed).
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = frozenset({"additionalProperties", "unevaluatedProperties", "allOf"})  # the schema decides


def strict_schema(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that does not set it
    (a new value; the given one is not changed)."""
    return _close(schema, close_here=True)


def _is_object_schema(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema


def _close(schema: Any, close_here: bool) -> Any:
    if isinstance(schema, list):  # `items` in its old tuple form
        return [_close(s, True) for s in schema]
    if not isinstance(schema, dict):
        return schema  # true / false, or a value this module does not read
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = _close(out[key], True)
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, True) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(s, False) for s in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, True) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _close(out["additionalProperties"], True)
    if close_here and _is_object_schema(out) and not _OPEN_KEYS & set(out):
        out["additionalProperties"] = False
    return out
