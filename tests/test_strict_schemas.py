"""Strict JSON schemas (`jaxserve.structured.strict_schema`) as the grammar enforces them: with the
tiny tokenizer and llguidance's matcher, a strict object refuses a property it does not list, at
every depth, and never repeats a listed one; `additionalProperties: true` (or a schema) keeps
extras; `allOf` still accepts what its branches list together; the given schema is not changed."""

from __future__ import annotations

import copy

import llguidance
import pytest

from checkpoints.tiny_random import build_tiny_tokenizer
from jaxserve.structured import GuidedDecoding, strict_schema

TOKENIZER = build_tiny_tokenizer()
LL = llguidance.LLTokenizer(TOKENIZER.to_str(), n_vocab=TOKENIZER.get_vocab_size(), eos_token=[0])
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def accepts(schema: dict, text: str) -> bool:
    """Whether the grammar of `schema` lets a model write `text` (as a prefix of its reply)."""
    matcher = llguidance.LLMatcher(LL, GuidedDecoding("json", schema).grammar, log_level=0)
    ids = TOKENIZER.encode(text).ids
    return matcher.validate_tokens(ids) == len(ids)


def test_plain_schemas_let_extra_keys_in_and_repeat_them():
    assert accepts(CITY, '{"city": "Paris", "weather": "sun", "weather": "rain"}')
    assert not accepts(CITY, '{"city": "Paris", "city": "Lyon"}')  # listed keys never repeat


def test_strict_objects_hold_only_their_properties():
    strict = strict_schema(CITY)
    assert strict == {**CITY, "additionalProperties": False}
    assert accepts(strict, '{"city": "Paris"}')
    assert not accepts(strict, '{"city": "Paris", "w')
    assert not accepts(strict, '{"w')


@pytest.mark.parametrize(
    "schema,inner",
    [
        ({"type": "object", "properties": {"place": CITY}}, '{"place": {"city": "Paris", "x'),
        ({"type": "array", "items": CITY}, '[{"city": "Paris", "x'),
        (
            {"$defs": {"c": CITY}, "type": "object", "properties": {"a": {"$ref": "#/$defs/c"}}},
            '{"a": {"city": "P", "x',
        ),
        ({"anyOf": [CITY, {"type": "integer"}]}, '{"city": "P", "x'),
    ],
    ids=["properties", "items", "defs", "anyOf"],
)
def test_strict_closes_objects_at_every_depth(schema, inner):
    assert accepts(schema, inner)
    assert not accepts(strict_schema(schema), inner)


def test_schemas_that_allow_extras_keep_them():
    for extra in (True, {"type": "integer"}):
        schema = {**CITY, "additionalProperties": extra}
        assert strict_schema(schema) == schema
        assert accepts(strict_schema(schema), '{"city": "Paris", "n": 1')
    nested = {"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": CITY}
    assert not accepts(strict_schema(nested), '{"c": {"city": "P", "x')  # the extras' own schema is closed


def test_all_of_branches_together_and_the_input_unchanged():
    schema = {"allOf": [CITY, {"type": "object", "properties": {"n": {"type": "integer"}}}]}
    before = copy.deepcopy(schema)
    strict = strict_schema(schema)
    assert schema == before and "additionalProperties" not in strict["allOf"][0]
    assert accepts(strict, '{"city": "Paris", "n": 1}')
