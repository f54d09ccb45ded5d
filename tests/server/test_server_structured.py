"""Structured output and tool calling through the server, on the tiny random model, with the
official client: response_format and vLLM's guided_* fields (streamed and not, n > 1, sessions),
tool_choice required / named / auto / none in OpenAI's shapes, and 400s for bad schemas and
bad tool specs. The KV pool is all free after every test."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_harness import KEY_A, MODEL_NAME, send, wait_until_idle

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["colour", "size"],
    "additionalProperties": False,
}
# Small tools, one or two at a time: the tiny model's tokenizer spends about a token per character of
# the prompt, and its context is 512 tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def kv_all_free_after(server, async_engine, assert_kv_all_free):
    yield
    wait_until_idle(server, async_engine)
    server.engine_call(async_engine, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])


def response_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def test_json_schema_reply_streamed_and_not_with_n_choices(client):
    full = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=60,
        temperature=0.9,
        seed=5,
        n=3,
        response_format=response_format(),
    )
    for choice in full.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    texts = [""] * 3
    for chunk in client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=60,
        temperature=0.9,
        seed=5,
        n=3,
        response_format=response_format(),
        stream=True,
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in full.choices]


def test_json_object_and_guided_extras_on_completions(client):
    obj = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=80, temperature=0, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a valid JSON prefix, starting an object
        assert obj.choices[0].message.content.startswith("{")
    regex = client.completions.create(
        model=MODEL_NAME, prompt="id:", max_tokens=20, temperature=0, extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"}
    )
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"
    choice = client.completions.create(
        model=MODEL_NAME,
        prompt="pick:",
        max_tokens=20,
        temperature=0.7,
        seed=1,
        extra_body={"guided_choice": ["alpha", "beta"]},
    )
    assert choice.choices[0].text in ("alpha", "beta")
    grammar = client.completions.create(
        model=MODEL_NAME,
        prompt="g:",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= "ab" [0-9] "!"'},
    )
    assert re.fullmatch("ab[0-9]!", grammar.choices[0].text)
    as_text = client.completions.create(
        model=MODEL_NAME, prompt="j:", max_tokens=60, temperature=0, extra_body={"guided_json": json.dumps(SCHEMA)}
    )
    jsonschema.validate(json.loads(as_text.choices[0].text), SCHEMA)


def test_session_message_with_response_format(server):
    created = send(server, "POST", "/v1/sessions", {"temperature": 0, "max_tokens": 60}).json
    reply = send(
        server,
        "POST",
        f"/v1/sessions/{created['id']}/messages",
        {"content": "Describe a thing.", "response_format": response_format()},
    )
    assert reply.status == 200, reply.text
    jsonschema.validate(json.loads(reply.json["choices"][0]["message"]["content"]), SCHEMA)
    send(server, "DELETE", f"/v1/sessions/{created['id']}")


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("response_format", response_format({"type": "objectx"}), "Invalid type: objectx"),
        ("response_format", {"type": "yaml"}, "response_format"),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}, "unsupported fields"),
        ("guided_json", "{not json", "not valid JSON"),
        ("guided_regex", "a(b", "unclosed group"),
        ("guided_choice", [], "non-empty list"),
        ("guided_grammar", "root ::= (((", "grammar"),
    ],
)
def test_constraints_the_library_rejects_are_400_naming_the_problem(server, field, value, message):
    reply = send(server, "POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, field: value})
    assert reply.status == 400, reply.text
    assert message in reply.json["error"]["message"] and reply.json["error"]["param"] == field


def test_two_constraints_at_once_are_400(server):
    reply = send(
        server,
        "POST",
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]},
    )
    assert reply.status == 400 and "at most one" in reply.json["error"]["message"]


@pytest.mark.parametrize(
    "tools,tool_choice,message",
    [
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "function.name"),
        ([{"type": "retrieval"}], "auto", "tools[0]"),
        ([WEATHER, WEATHER], "auto", "given twice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
            "auto",
            "Invalid type: objectx",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {}, "colour": 1}}],
            "auto",
            "unsupported fields",
        ),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        ([], "required", "needs tools"),
        ([WEATHER], "sometimes", "tool_choice must be"),
    ],
)
def test_bad_tool_specs_are_400(server, tools, tool_choice, message):
    reply = send(
        server,
        "POST",
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": MESSAGES, "tools": tools, "tool_choice": tool_choice},
    )
    assert reply.status == 400, reply.text
    assert message in reply.json["error"]["message"]


def check_calls(calls, allowed_names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed_names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("seed", range(4))
def test_required_always_yields_a_valid_call(client, seed):
    full = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=70,
        temperature=1.0,
        seed=seed,
        tools=[TIME if seed % 2 else WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message.content
    check_calls(choice.message.tool_calls, {"time" if seed % 2 else "weather"})


def test_required_streamed_gives_indexed_tool_call_deltas(client):
    kwargs = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=70,
        temperature=0,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    full = client.chat.completions.create(**kwargs)
    deltas, finish = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and {d.index for d in deltas} == {0} and len(deltas) > 2
    first = deltas[0]  # id and name first, with no arguments yet; then argument fragments only
    assert first.id.startswith("call_") and first.type == "function" and first.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    (whole,) = full.choices[0].message.tool_calls
    assert (first.function.name, "".join(d.function.arguments for d in deltas)) == (
        whole.function.name,
        whole.function.arguments,
    )


def test_named_function_yields_that_function(client):
    for stream in (False, True):
        kwargs = dict(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=20,
            temperature=0.8,
            seed=2,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "time"}},
        )
        if not stream:
            calls = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        else:
            deltas = [
                d
                for chunk in client.chat.completions.create(**kwargs, stream=True)
                for c in chunk.choices
                for d in c.delta.tool_calls or []
            ]
            assert {d.index for d in deltas} == {0} and deltas[0].function.arguments == ""
            calls = [deltas[0]]  # the call's id and name, then its argument fragments
            calls[0].function.arguments = "".join(d.function.arguments for d in deltas)
        assert len(calls) == 1
        check_calls(calls, {"time"})


def test_named_function_finishes_with_stop_as_openai_does(client):
    kwargs = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )
    assert client.chat.completions.create(**kwargs).choices[0].finish_reason == "stop"
    finish = [c.finish_reason for chunk in client.chat.completions.create(**kwargs, stream=True) for c in chunk.choices]
    assert finish[-1] == "stop"


def _streamed_calls(client, kwargs):
    """(tool call deltas, finish reason, content) of a streamed chat completion."""
    deltas, finish, content = [], None, ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    return deltas, finish, content


@pytest.mark.parametrize(
    "tool_choice,max_tokens", [({"type": "function", "function": {"name": "weather"}}, 4), ("required", 30)]
)
def test_a_forced_call_cut_by_max_tokens_comes_back_as_a_partial_call(client, tool_choice, max_tokens):
    """OpenAI (and vLLM for a named tool) return the call with its arguments so far and finish_reason
    "length", never the constrained text as content."""
    kwargs = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather"
    whole = client.chat.completions.create(**{**kwargs, "max_tokens": 80}).choices[0].message.tool_calls[0]
    assert (
        whole.function.arguments.startswith(call.function.arguments)
        and whole.function.arguments != call.function.arguments
    )
    deltas, finish, content = _streamed_calls(client, kwargs)
    assert finish == "length" and not content
    assert [(d.index, d.function.name) for d in deltas] == [(0, "weather")] + [(0, None)] * (len(deltas) - 1)
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments


def test_auto_yields_text_or_calls_and_none_yields_text(client):
    for tool_choice in ("auto", "none"):
        full = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0, tools=[WEATHER], tool_choice=tool_choice
        )
        choice = full.choices[0]
        if choice.message.tool_calls:
            assert tool_choice == "auto" and choice.finish_reason == "tool_calls"
            check_calls(choice.message.tool_calls, {"weather"})
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_a_conversation_with_earlier_calls_and_results_is_accepted(client):
    messages = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, tools=[WEATHER]
    )
    assert full.choices[0].finish_reason in ("stop", "length", "tool_calls")
