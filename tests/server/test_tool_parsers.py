"""Tool-call parsing and the streamed tool-call shape, without an engine: the Hermes-style format
(the default model's) and Llama 3's, text before a call, several calls, malformed calls left as
content, forced calls cut short, OpenAI's finish reasons, what a stream holds back, and
`delta.tool_calls` streamed: id and name first, then argument fragments."""

from __future__ import annotations

import json

import pytest

from jaxserve.outputs import Delta
from server.openai_bodies import ChatShapes
from server.reply_stream import ReplyParsing
from server.tools import ToolCall, ToolCalling, ToolChoice, ToolFormat, forced_constraint, parse_forced

HERMES = ToolFormat("{% for m in messages %}{{ m['content'] }}{% endfor %}")  # renders no tools
LLAMA3 = ToolFormat("{% if tools %}{{ tools | tojson }}{% endif %}<|python_tag|>")


def test_hermes_calls_with_content_before_them():
    text = (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    content, calls = HERMES.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]


@pytest.mark.parametrize(
    "text", ["no call here", '<tool_call>{"name": "a", "arguments": ', "<tool_call>[1]</tool_call>"]
)
def test_hermes_text_without_a_whole_call_is_content(text):
    assert HERMES.parse(text) == (text, [])


def test_llama3_calls_with_python_tag_and_semicolons():
    text = '<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "parameters": {"n": 2}}'
    content, calls = LLAMA3.parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"q": "x"}),
        ("b", {"n": 2}),
    ]
    assert LLAMA3.parse("Paris is sunny.") == ("Paris is sunny.", [])


def test_holdback_of_a_partial_marker():
    assert HERMES.holdback("Sure <tool") == len("<tool")
    assert HERMES.holdback("Sure") == 0
    assert LLAMA3.holdback("  ") == 2 and LLAMA3.holdback("<|pyth") == len("<|pyth") and LLAMA3.holdback("Hi") == 0


def test_forced_constraints_and_their_parse():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    required = forced_constraint(tools, ToolChoice("required"), parallel=False)
    assert required.value["maxItems"] == 1 and required.value["items"]["anyOf"][0]["properties"]["name"] == {
        "const": "f"
    }
    strict = forced_constraint(tools, ToolChoice("function", "f"), True).value
    assert strict == {"type": "object", "additionalProperties": False}  # strict by default
    assert forced_constraint(tools, ToolChoice("function", "f"), True, strict=False).value == {"type": "object"}
    loose = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": False}}]
    assert forced_constraint(loose, ToolChoice("function", "f"), True).value == {"type": "object"}
    assert forced_constraint(tools, ToolChoice("auto"), True) is None
    calls = parse_forced('[{"name": "f", "parameters": {"k": [1]}}]', ToolChoice("required"))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"k": [1]})]


def test_forced_calls_cut_short_keep_what_they_hold():
    assert parse_forced('{"k": 1', ToolChoice("function", "f")) == [ToolCall("f", '{"k": 1')]
    cut = '[{"name": "f", "parameters": {"k": [1, {"s": "}]"}]}}, {"name": "g", "parameters": {"x": "a\\"'
    assert parse_forced(cut, ToolChoice("required")) == [
        ToolCall("f", '{"k": [1, {"s": "}]"}]}'),
        ToolCall("g", '{"x": "a\\"'),
    ]
    assert parse_forced('[{"name": "f", "param', ToolChoice("required")) == [ToolCall("f", "")]
    assert parse_forced('[{"name": "f', ToolChoice("required")) == []  # its name was cut


@pytest.mark.parametrize(
    "choice,text,finish,want",
    [
        (ToolChoice("function", "f"), '{"k": 1}', "stop", "stop"),
        (ToolChoice("function", "f"), '{"k": ', "length", "length"),
        (ToolChoice("required"), '[{"name": "f", "parameters": {}}]', "stop", "tool_calls"),
        (ToolChoice("required"), '[{"name": "f", "parameters": {', "length", "length"),
        (ToolChoice("auto"), '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "stop", "tool_calls"),
        (ToolChoice("auto"), "Hello", "stop", "stop"),
    ],
)
def test_finish_reasons_are_openais(choice, text, finish, want):
    content, calls, reason = ToolCalling(HERMES, choice).reply(text, finish)
    assert reason == want
    assert content is None if choice.mode != "auto" else (calls or content == text)


class _Info:
    name = "m"


def _delta(text: str, finish: str | None = None) -> Delta:
    return Delta("r", 0, text, [1], None, finish, None)


def test_stream_shows_content_then_the_call_id_and_name_then_its_arguments():
    shapes = ChatShapes("id", _Info(), ReplyParsing(ToolCalling(HERMES, ToolChoice("auto"))))
    pieces = ["Checking", " <tool", '_call>{"name": "a", ', '"arguments": {"x":', " 2}}</tool_call>", ""]
    per_delta = [
        shapes.chunks(0, _delta(p, "stop" if i == len(pieces) - 1 else None), False) for i, p in enumerate(pieces)
    ]
    chunks = [c["choices"][0] for batch in per_delta for c in batch]
    shown = [c["delta"].get("content") for c in chunks]
    assert "".join(s for s in shown if s) == "Checking"  # as the whole reply has it
    calls = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    first = calls[0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "a", "arguments": ""}
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert len(calls) > 2  # the arguments came in more than one fragment
    assert "".join(c["function"]["arguments"] for c in calls) == '{"x": 2}'
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_response_without_calls_keeps_its_text_and_finish_reason():
    from server.openai_bodies import ChoiceOutput, UsageCount

    shapes = ChatShapes("id", _Info(), ReplyParsing(ToolCalling(HERMES, ToolChoice("auto"))))
    body = shapes.response([ChoiceOutput(text="Hello", finish_reason="length")], UsageCount())
    assert body["choices"][0]["message"]["content"] == "Hello" and body["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in body["choices"][0]["message"]
