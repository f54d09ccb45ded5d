"""Anthropic's Messages API refusing what it cannot serve (tiny random model): every bad request gets
Anthropic's error shape (`{"type": "error", "error": {"type", "message"}}`) with the right status and
type, never a 500; keys as `x-api-key` or Bearer; rate limits; a stream stopped after it started
ends with an `error` event, one the client leaves is aborted; each event named by its `event:` line; a property-based
fuzz of both routes. The KV pool is all free after each test."""

from __future__ import annotations

import json
import threading

import anthropic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import KEY_A, KEY_B, MODEL_NAME, send, snapshot, start_server, wait_until_idle

from server.state import STATE

HI = [{"role": "user", "content": "Hi"}]
BASE = {"model": MODEL_NAME, "max_tokens": 4, "messages": HI}
TOOL = {"name": "note", "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}}
CALLED = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "note", "input": {}}]}


def _result(tool_use_id: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "ok"}]}


@pytest.fixture
def messages_server(server, async_engine, assert_kv_all_free):
    yield server
    wait_until_idle(server, async_engine)
    server.engine_call(async_engine, lambda router: [assert_kv_all_free(e) for e in router.replicas])


def _anthropic_error(reply, status: int, kind: str) -> str:
    assert reply.status == status, reply.text
    body = reply.json
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body["error"]["message"]


BAD_BODIES = {
    "max_tokens missing": ({"messages": HI}, "max_tokens"),
    "max_tokens zero": ({**BASE, "max_tokens": 0}, "max_tokens"),
    "max_tokens absurd": ({**BASE, "max_tokens": 10**12}, "max_tokens"),
    "max_tokens past the context": ({**BASE, "max_tokens": 505}, "context"),
    "max_tokens a string": ({**BASE, "max_tokens": "4"}, "max_tokens"),
    "messages missing": ({"max_tokens": 4}, "messages"),
    "messages empty": ({**BASE, "messages": []}, "messages"),
    "a system message": ({**BASE, "messages": [{"role": "system", "content": "x"}, *HI]}, "system"),
    "first message from the assistant": ({**BASE, "messages": [{"role": "assistant", "content": "x"}]}, "first"),
    "an image block": (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "this model takes no images",
    ),
    "a document block": (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        "document",
    ),
    "an image in a tool result": (
        {
            **BASE,
            "tools": [TOOL],
            "messages": [
                *HI,
                CALLED,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image"}]}],
                },
            ],
        },
        "this model takes no images",
    ),
    "an unknown block type": ({**BASE, "messages": [{"role": "user", "content": [{"type": "thinking"}]}]}, "thinking"),
    "tool_use from the user": (
        {**BASE, "messages": [{"role": "user", "content": CALLED["content"]}]},
        "tool_use",
    ),
    "tool_result from the assistant": ({**BASE, "messages": [*HI, {**_result("toolu_1"), "role": "assistant"}]}, "not"),
    "an unknown tool_use id": ({**BASE, "tools": [TOOL], "messages": [*HI, CALLED, _result("toolu_2")]}, "toolu_2"),
    "a tool_result with no tool_use before": ({**BASE, "messages": [_result("toolu_1")]}, "toolu_1"),
    "a tool_use id used twice": (
        {**BASE, "tools": [TOOL], "messages": [*HI, CALLED, _result("toolu_1"), CALLED, _result("toolu_1")]},
        "twice",
    ),
    "a tool_use input not an object": (
        {**BASE, "messages": [*HI, {"role": "assistant", "content": [{**CALLED["content"][0], "input": "x"}]}]},
        "input",
    ),
    "an empty text block": (
        {**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
        "text",
    ),
    "empty content": ({**BASE, "messages": [{"role": "user", "content": []}]}, "non-empty"),
    "prefill ending in whitespace": (
        {**BASE, "messages": [*HI, {"role": "assistant", "content": "So "}]},
        "whitespace",
    ),
    "an unknown field": ({**BASE, "frequency_penalty": 1}, "frequency_penalty"),
    "a server tool": ({**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "custom tools"),
    "a tool without input_schema": ({**BASE, "tools": [{"name": "x"}]}, "input_schema"),
    "a tool with a bad name": ({**BASE, "tools": [{**TOOL, "name": "a b"}]}, "name"),
    "a tool given twice": ({**BASE, "tools": [TOOL, TOOL]}, "twice"),
    "a bad input_schema": ({**BASE, "tools": [{**TOOL, "input_schema": {"type": "object", "properties": 3}}]}, "tools"),
    "tool_choice naming no tool": ({**BASE, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "x"}}, "x"),
    "tool_choice any without tools": ({**BASE, "tool_choice": {"type": "any"}}, "needs tools"),
    "tool_choice of OpenAI's shape": ({**BASE, "tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    "thinking": ({**BASE, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    "stop_sequences not a list": ({**BASE, "stop_sequences": "x"}, "stop_sequences"),
    "an empty stop sequence": ({**BASE, "stop_sequences": [""]}, "stop_sequences"),
    "metadata with other keys": ({**BASE, "metadata": {"user": "x"}}, "metadata"),
    "temperature not a number": ({**BASE, "temperature": "hot"}, "temperature"),
    "stream not a boolean": ({**BASE, "stream": "yes"}, "stream"),
    "a prompt over the context": ({**BASE, "messages": [{"role": "user", "content": "word " * 600}]}, "context"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_requests_get_anthropics_error_shape(messages_server, case):
    body, words = BAD_BODIES[case]
    for stream in (False, True):
        reply = send(messages_server, "POST", "/v1/messages", {**body, "stream": stream} if stream else body)
        if case == "stream not a boolean" and stream:
            continue  # the case is its stream value
        message = _anthropic_error(reply, 400, "invalid_request_error")
        assert words.lower() in message.lower(), (case, message)


def test_count_tokens_refuses_what_messages_refuses(messages_server):
    for case in ("messages missing", "an image block", "an unknown tool_use id", "tool_choice naming no tool"):
        body = {k: v for k, v in BAD_BODIES[case][0].items() if k != "max_tokens"}
        _anthropic_error(send(messages_server, "POST", "/v1/messages/count_tokens", body), 400, "invalid_request_error")
    reply = send(messages_server, "POST", "/v1/messages/count_tokens", {"messages": HI, "max_tokens": 4})
    _anthropic_error(reply, 400, "invalid_request_error")  # not one of count_tokens' fields


def test_malformed_bodies_unknown_models_and_paths(messages_server):
    for raw in (b"{not json", b"[1, 2]", b"", b'{"max_tokens": 4, "messages": [' * 40, b"\xff\xfe"):
        reply = send(messages_server, "POST", "/v1/messages", raw=raw)
        _anthropic_error(reply, 400, "invalid_request_error")
    _anthropic_error(
        send(messages_server, "POST", "/v1/messages", {**BASE, "model": "claude-x"}), 404, "not_found_error"
    )
    _anthropic_error(send(messages_server, "POST", "/v1/messages/nope", BASE), 404, "not_found_error")
    _anthropic_error(send(messages_server, "GET", "/v1/messages"), 405, "invalid_request_error")
    # other routes keep OpenAI's shape
    assert set(send(messages_server, "POST", "/v1/chat/completions", {}).json) == {"error"}


def test_keys_as_x_api_key_or_bearer(messages_server):
    headers = {"anthropic-version": "2023-06-01"}
    ok = send(messages_server, "POST", "/v1/messages", BASE, key=None, headers={**headers, "x-api-key": KEY_B})
    assert ok.status == 200 and ok.json["type"] == "message"
    assert send(messages_server, "POST", "/v1/messages", BASE, key=KEY_A, headers=headers).status == 200
    for wrong in (
        {"x-api-key": "nope"},
        {},
        {"Authorization": "Basic x"},
        {"x-api-key": "nope", "Authorization": f"Bearer {KEY_A}"},
    ):
        reply = send(messages_server, "POST", "/v1/messages", BASE, key=None, headers=wrong)
        _anthropic_error(reply, 401, "authentication_error")
    reply = send(messages_server, "GET", "/v1/models", key=None, headers={"x-api-key": KEY_A})
    assert reply.status == 200  # x-api-key is a key on every route
    wrong = anthropic.Anthropic(base_url=messages_server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL_NAME, max_tokens=2, messages=HI)
    bearer = anthropic.Anthropic(base_url=messages_server.base_url, auth_token=KEY_A, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL_NAME, messages=HI).input_tokens > 0


def test_rate_limits_are_rate_limit_errors(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), rate_limit_rpm=1)
    try:
        client = anthropic.Anthropic(base_url=srv.base_url, api_key=KEY_A, max_retries=0)
        client.messages.create(model=MODEL_NAME, max_tokens=2, messages=HI)
        with pytest.raises(anthropic.RateLimitError) as raised:
            client.messages.create(model=MODEL_NAME, max_tokens=2, messages=HI)
        assert raised.value.body["error"]["type"] == "rate_limit_error"
        assert raised.value.response.headers.get("retry-after")
    finally:
        srv.stop()


def _long_greedy_body(**extra) -> dict:
    return {**BASE, "max_tokens": 200, "temperature": 0, "messages": [{"role": "user", "content": "Go on"}], **extra}


def test_a_stream_stopped_after_it_started_ends_with_an_error_event(messages_server):
    whole = send(messages_server, "POST", "/v1/messages", _long_greedy_body())
    assert whole.json["stop_reason"] == "max_tokens"  # greedy: the stream below runs as long
    client = anthropic.Anthropic(base_url=messages_server.base_url, api_key=KEY_A, max_retries=0)
    body = _long_greedy_body()
    stream = client.messages.create(
        stream=True, model=MODEL_NAME, max_tokens=200, messages=body["messages"], extra_body={"temperature": 0}
    )
    state = messages_server.app[STATE]
    assert next(iter(stream)).type == "message_start"

    async def stop_all() -> None:
        for generation in state.in_flight():
            generation.shut_down()

    messages_server.run(stop_all())
    with pytest.raises(anthropic.APIStatusError) as raised:
        for _ in stream:
            pass
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "overloaded_error"


def test_a_client_leaving_a_stream_aborts_its_generation(messages_server, async_engine):
    whole = send(messages_server, "POST", "/v1/messages", _long_greedy_body())
    assert whole.json["stop_reason"] == "max_tokens"  # greedy: the stream below would run as long
    before = snapshot(messages_server, async_engine).generated_tokens
    client = anthropic.Anthropic(base_url=messages_server.base_url, api_key=KEY_A, max_retries=0)
    body = _long_greedy_body()
    stream = client.messages.create(
        stream=True, model=MODEL_NAME, max_tokens=200, messages=body["messages"], extra_body={"temperature": 0}
    )
    assert next(iter(stream)).type == "message_start"
    stream.close()
    snap = wait_until_idle(messages_server, async_engine)
    assert not snap.has_unfinished and snap.generated_tokens - before < 150


def test_a_stream_names_each_event(messages_server):
    body = _long_greedy_body(
        max_tokens=64,
        stream=True,
        tools=[{**TOOL, "input_schema": {**TOOL["input_schema"], "required": ["text"]}}],
        tool_choice={"type": "any"},  # the calls are shown at the end only
    )
    reply = send(messages_server, "POST", "/v1/messages", body)
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in reply.text.split("\n\n"):
        if block:
            head, data = block.split("\n", 1)
            events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == payload["type"] for name, payload in events)
    names = [name for name, _ in events if name != "ping"]
    assert events[1][0] == "ping" and names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_block, stopped = None, 0  # each block started, filled and stopped before the next, in index order
    for name, payload in events:
        if name == "content_block_start":
            assert open_block is None and payload["index"] == stopped
            assert payload["content_block"]["type"] == "tool_use"
            open_block = payload["index"]
        elif name in ("content_block_delta", "content_block_stop"):
            assert payload["index"] == open_block
            if name == "content_block_stop":
                open_block, stopped = None, stopped + 1
    assert open_block is None and stopped > 0


# ----- fuzz ------------------------------------------------------------------------------------
# Bodies drawn three ways: each field a valid value (so requests get served), valid bodies with one
# field replaced by any JSON value or hostile blocks (each refusal path is reached), and any value.

texts = st.one_of(st.text(max_size=8), st.sampled_from(["\ud800", "x" * 200, "<|im_start|>", "", " "]))
scalars = st.none() | st.booleans() | st.integers() | st.floats() | texts
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3))
block_types = st.sampled_from(["text", "image", "document", "tool_use", "tool_result", "thinking", "x"])
hostile_block = st.fixed_dictionaries(
    {"type": block_types},
    optional={"text": texts, "id": texts, "name": texts, "input": anything, "tool_use_id": texts, "content": anything},
)
hostile_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "x"]),
        "content": st.one_of(texts, st.lists(hostile_block)),
    }
)
words = st.sampled_from(["Hi", "Tell me", "x" * 60, "<|im_start|>", "\u00fcn\u00ef", "<tool_call>"])
text_blocks = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), min_size=1, max_size=2)
user_message = st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(words, text_blocks)})
VALID = {
    "model": st.just(MODEL_NAME),
    "max_tokens": st.integers(1, 4),
    "messages": st.lists(user_message, min_size=1, max_size=2),
    "system": st.one_of(words, text_blocks),
    "stop_sequences": st.lists(st.sampled_from(["a", "\n", "END"]), max_size=2),
    "stream": st.booleans(),
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0.1, 1),
    "top_k": st.integers(0, 50),
    "tools": st.lists(st.just(TOOL), max_size=1),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}, {"type": "any"}]),
    "metadata": st.just({"user_id": "u"}),
}
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice")


def bodies(path: str) -> st.SearchStrategy:
    fields = VALID if path == "/v1/messages" else {k: VALID[k] for k in COUNT_FIELDS}
    required = {k: v for k, v in fields.items() if k in ("max_tokens", "messages")}
    shaped = st.fixed_dictionaries(required, optional={k: v for k, v in fields.items() if k not in required})
    replaced = st.builds(lambda b, k, v: {**b, k: v}, shaped, st.sampled_from(sorted(fields)), anything)
    hostile = st.builds(lambda b, m: {**b, "messages": m}, shaped, st.lists(hostile_message, min_size=1, max_size=3))
    return st.one_of(shaped, shaped, replaced, hostile, anything)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_bodies_never_get_a_5xx(messages_server, path, data):
    body = data.draw(bodies(path))
    reply = send(messages_server, "POST", path, raw=json.dumps(body).encode())
    assert reply.status < 500, reply.text
    if reply.status >= 400:
        assert reply.json["type"] == "error" and reply.json["error"]["type"] != "api_error", reply.text
    elif reply.headers["content-type"].startswith("text/event-stream"):
        assert reply.text.rstrip().endswith('"message_stop"}'), reply.text[-300:]
    elif path == "/v1/messages":
        assert reply.json["type"] == "message" and reply.json["usage"]["output_tokens"] <= body["max_tokens"]
    else:
        assert reply.json["input_tokens"] > 0


def test_concurrent_streams_share_the_engine(messages_server):
    client = anthropic.Anthropic(base_url=messages_server.base_url, api_key=KEY_A, max_retries=0)
    texts_out: dict[int, str] = {}

    def run(i: int) -> None:
        with client.messages.stream(
            model=MODEL_NAME, max_tokens=8, messages=[{"role": "user", "content": f"n{i}"}]
        ) as s:
            texts_out[i] = s.get_final_text()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(texts_out) == 6
