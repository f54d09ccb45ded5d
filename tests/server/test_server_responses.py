"""The Responses API (`/v1/responses`) on the tiny random model, through the official openai client:
create (stream and not), retrieve, delete, input_items, chains by `previous_response_id` that reuse
their KV, tools and function-call items, `text.format`, `max_output_tokens`, `store: false`,
background responses and their cancel, a stream that fails midway, keys, rate limits, metrics,
per-key isolation and bad input. After every test the
stored responses are deleted and the KV pool is all free (nothing left pinned)."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from server_harness import (
    BLOCK_SIZE,
    KEY_A,
    KEY_B,
    MODEL_NAME,
    send,
    start_server,
)

from jaxserve import faults

WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "size": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["colour", "size"],
    "additionalProperties": False,
}
GREEDY = dict(model=MODEL_NAME, temperature=0, max_output_tokens=8)

pytestmark = pytest.mark.usefixtures("stored_responses_cleared")


def test_create_retrieve_input_items_and_delete(client):
    created = client.responses.create(input="Hello there, how are you?", instructions="Be brief.", **GREEDY)
    assert created.object == "response" and created.id.startswith("resp_")
    assert created.status in ("completed", "incomplete")
    (message,) = created.output
    assert message.type == "message" and message.role == "assistant" and created.output_text == message.content[0].text
    assert (
        created.usage.output_tokens >= 1
        and created.usage.total_tokens == created.usage.input_tokens + created.usage.output_tokens
    )
    assert created.instructions == "Be brief." and created.store and created.model == MODEL_NAME
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    items = client.responses.input_items.list(created.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "Hello there, how are you?")
    ]
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_stream_sends_openais_event_sequence_and_equals_the_stored_response(client):
    events = list(client.responses.create(input="Tell me a story.", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        kinds[-1],
    ] and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens >= 1
    unstreamed = client.responses.create(input="Tell me a story.", **GREEDY)
    assert unstreamed.output_text == text  # greedy: the same reply
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_a_chain_reuses_its_kv_and_each_link_holds_its_own_history(client):
    # Instructions are not carried over (as at OpenAI): each link gives them, as the Agents SDK does.
    kw = dict(instructions="Be brief.", **GREEDY)
    first = client.responses.create(input="The quick brown fox jumps over the lazy dog. " * 3, **kw)
    second = client.responses.create(input="And then?", previous_response_id=first.id, **kw)
    history = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > history
    assert second.usage.input_tokens_details.cached_tokens >= (history - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.previous_response_id == first.id
    branch = client.responses.create(input="Something else.", previous_response_id=first.id, **kw)
    assert branch.usage.input_tokens_details.cached_tokens >= (history - 1) // BLOCK_SIZE * BLOCK_SIZE
    third = client.responses.create(input="Go on.", previous_response_id=second.id, stream=True, **kw)
    final = [e for e in third if e.type in ("response.completed", "response.incomplete")][-1].response
    history = second.usage.input_tokens + second.usage.output_tokens
    assert final.usage.input_tokens > history
    assert final.usage.input_tokens_details.cached_tokens >= (history - 1) // BLOCK_SIZE * BLOCK_SIZE
    without = client.responses.create(input="Go on.", previous_response_id=second.id, **GREEDY)
    assert without.usage.input_tokens < final.usage.input_tokens  # no instructions: the template's default


def test_text_format_json_schema(client):
    out = client.responses.create(
        input="A thing?",
        model=MODEL_NAME,
        temperature=0.7,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}},
    )
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text.format.type == "json_schema"


def test_forced_function_calls_then_their_output_continues_the_chain(client):
    call_response = client.responses.create(
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the array closes: sampled, it still completes
        model=MODEL_NAME,
        temperature=0.8,
        max_output_tokens=60,
    )
    (call,) = call_response.output
    assert call.type == "function_call" and call.name == "weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome") and call_response.status == "completed"
    named = client.responses.create(
        input="Weather?",
        tools=[WEATHER],
        model=MODEL_NAME,
        max_output_tokens=60,
        tool_choice={"type": "function", "name": "weather"},
    )
    assert [o.type for o in named.output] == ["function_call"]
    followed = client.responses.create(
        previous_response_id=call_response.id,
        tools=[WEATHER],
        **GREEDY,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}],
    )
    assert followed.status in ("completed", "incomplete")
    assert followed.usage.input_tokens > call_response.usage.input_tokens
    # The same conversation sent whole, as the Agents SDK does (no previous_response_id).
    whole = client.responses.create(
        tools=[WEATHER],
        **GREEDY,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"},
        ],
    )
    assert [i.type for i in client.responses.input_items.list(whole.id, order="asc").data] == [
        "message",
        "function_call",
        "function_call_output",
    ]


def test_a_forced_call_cut_by_max_output_tokens_is_an_incomplete_call(client):
    out = client.responses.create(
        input="Weather?",
        tools=[WEATHER],
        model=MODEL_NAME,
        temperature=0,
        max_output_tokens=3,
        tool_choice={"type": "function", "name": "weather"},
    )
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    (call,) = out.output
    assert call.type == "function_call" and call.status == "incomplete" and call.arguments.startswith("{")


def test_store_false_keeps_nothing_and_other_keys_see_nothing(client, server):
    unstored = client.responses.create(input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    stored = client.responses.create(input="Hi", **GREEDY)
    other = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_B, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(input="Hi", previous_response_id=stored.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"
    assert send(server, "GET", f"/v1/sessions/{stored.id}").status == 404  # not a session
    assert stored.id not in [s["id"] for s in send(server, "GET", "/v1/sessions").json["data"]]


def test_background_response_completes_and_one_can_be_cancelled(client):
    started = client.responses.create(input="Count to ten.", background=True, **GREEDY)
    assert started.status in ("queued", "in_progress") and started.background
    deadline = time.monotonic() + 30
    while (done := client.responses.retrieve(started.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert done.status in ("completed", "incomplete") and done.output_text
    long = client.responses.create(
        input="Write a long essay.", background=True, model=MODEL_NAME, max_output_tokens=400, extra_body={"top_k": 1}
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id if not done.background else client.responses.create(input="x", **GREEDY).id)


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "t"}}}, "text"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "nope"}}}}, "text"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
        ({"input": "x", "conversation": 7}, "conversation"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "temperature": -1}, "temperature"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    reply = send(server, "POST", "/v1/responses", {"model": MODEL_NAME, **body})
    assert reply.status == 400, reply.text
    assert reply.json["error"]["param"] == param, reply.text


def test_an_image_to_a_text_model_is_a_400(server):
    content = [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}, {"type": "input_text", "text": "hi"}]
    reply = send(
        server, "POST", "/v1/responses", {"model": MODEL_NAME, "input": [{"role": "user", "content": content}]}
    )
    assert reply.status == 400 and reply.json["error"]["param"] == "input", reply.text
    assert reply.json["error"]["message"] == "input[0].content[0]: this model takes no images (it has no vision tower)"


def test_input_items_pages(client):
    items = [{"role": "user", "content": f"Line {i}"} for i in range(5)]
    out = client.responses.create(input=items, **GREEDY)
    first = client.responses.input_items.list(out.id, limit=2, order="asc")
    assert [i.content[0].text for i in first.data] == ["Line 0", "Line 1"] and first.has_more
    rest = client.responses.input_items.list(out.id, limit=10, order="asc", after=first.last_id)
    assert [i.content[0].text for i in rest.data] == ["Line 2", "Line 3", "Line 4"] and not rest.has_more
    newest = client.responses.input_items.list(out.id, limit=1)
    assert newest.data[0].content[0].text == "Line 4"


def test_a_stream_that_fails_midway_ends_with_response_failed_and_stores_nothing(client):
    events = client.responses.create(
        input="Tell me everything.", model=MODEL_NAME, max_output_tokens=300, temperature=0, stream=True
    )
    first = next(iter(events))
    with faults.inject("detokenize", first.response.id):  # the engine fails this request's next token
        rest = list(events)
    assert rest[-1].type == "response.failed"
    assert rest[-1].response.status == "failed" and rest[-1].response.error.code == "internal_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.response.id)


def test_keys_rate_limits_and_metrics_apply(server, async_engine):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2}
    assert send(server, "POST", "/v1/responses", body, key=None).status == 401
    assert send(server, "POST", "/v1/responses", body, key="wrong").status == 401
    limited = start_server(async_engine, api_keys=(KEY_A,), rate_limit_rpm=1)
    try:
        assert send(limited, "POST", "/v1/responses", {**body, "store": False}).status == 200
        refused = send(limited, "POST", "/v1/responses", {**body, "store": False})
        assert refused.status == 429 and refused.json["error"]["type"] == "rate_limit_error"
    finally:
        limited.stop()
    before = _requests(server)
    assert send(server, "POST", "/v1/responses", {**body, "store": False}).status == 200
    assert _requests(server) == before + 1


def _requests(srv) -> float:
    for line in send(srv, "GET", "/metrics", key=None).text.splitlines():
        if line.startswith("jaxserve_requests_total{") and 'endpoint="responses"' in line and '"ok"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_truncation_auto_drops_the_oldest_items_and_keeps_the_instructions(client):
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "story " * 20} for i in range(9)
    ]
    kw = dict(instructions="Be brief.", store=False, **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=turns, **kw)  # truncation "disabled", the default
    assert e.value.body["code"] == "context_length_exceeded"
    fitting = []  # the newest turns that fit, with the instructions, as a plain request
    for k in range(1, len(turns) + 1):
        try:
            fitting.append(client.responses.create(input=turns[-k:], **kw))
        except openai.BadRequestError:
            break
    assert 2 <= len(fitting) < len(turns), len(fitting)
    truncated = client.responses.create(input=turns, truncation="auto", **kw)
    assert truncated.truncation == "auto"
    assert truncated.usage.input_tokens == fitting[-1].usage.input_tokens
    assert truncated.output_text == fitting[-1].output_text
    assert truncated.usage.input_tokens + GREEDY["max_output_tokens"] <= 512
    # The same through a conversation's items as the prior context.
    conv = client.conversations.create(items=turns[:-1])
    in_conv = client.responses.create(input=[turns[-1]], conversation=conv.id, truncation="auto", **kw)
    assert in_conv.usage.input_tokens == fitting[-1].usage.input_tokens
    with pytest.raises(openai.BadRequestError):
        client.responses.create(input=[turns[-1]], conversation=conv.id, **kw)
    client.conversations.delete(conv.id)
    with pytest.raises(openai.BadRequestError) as e:  # one message too long alone: still a 400
        client.responses.create(input="story " * 600, truncation="auto", **kw)
    assert e.value.body["code"] == "context_length_exceeded"


def test_a_streamed_reply_is_parsed_once_at_its_end(client, monkeypatch):
    from server.tools import ToolCalling

    parsed = []
    whole_parse = ToolCalling.reply
    monkeypatch.setattr(ToolCalling, "reply", lambda self, *a: parsed.append(a) or whole_parse(self, *a))
    kw = dict(input="Weather?", tools=[WEATHER], model=MODEL_NAME, temperature=0, max_output_tokens=30)
    events = list(client.responses.create(stream=True, tool_choice="required", **kw))
    assert len(parsed) == 1
    done = events[-1].response
    assert [o.type for o in done.output] == ["function_call"] and done.output[0].name == "weather"
