"""Property-based fuzz of every HTTP endpoint (hypothesis): no input, with or without a key,
gets a 5xx; every error has OpenAI's shape; the engine still serves afterwards, with its KV pool
back at its idle level.

Bodies are drawn three ways: valid-shaped (the endpoint's own fields, each a valid value or a
hostile one: huge and negative numbers, NaN, lone surrogates, wrong types, nesting), arbitrary
JSON values, and raw bytes (truncated JSON, deep nesting, 5,000-digit numbers, invalid UTF-8).
Derandomized, no example database: every CI run sends the same requests.
"""

from __future__ import annotations

import collections
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import MODEL_NAME, assert_serving_and_idle, send, sse_events, start_server

FUZZ_KEY = "key-fuzz"
EXAMPLES_PER_ENDPOINT = 100  # hypothesis's default
FUZZ = settings(
    max_examples=EXAMPLES_PER_ENDPOINT,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
STATUSES: collections.Counter = collections.Counter()  # (endpoint, status) -> count, for the summary

# ----- values ---------------------------------------------------------------------------------

HOSTILE_STRINGS = ["\ud800", "a\udfffb", "\x00", "\ue000 0 \ue000", "x" * 300, "<|im_start|>", "\u202e", ""]
ints = st.one_of(
    st.integers(-2, 6), st.sampled_from([2**31 - 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**40]), st.integers()
)
floats = st.one_of(st.floats(-3, 3), st.floats(), st.sampled_from([1e-45, 1e39, -0.0]))
texts = st.one_of(st.text(max_size=12), st.sampled_from(HOSTILE_STRINGS))
scalars = st.none() | st.booleans() | ints | floats | texts
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=8
)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the right shape, sometimes anything."""
    return st.one_of(valid, valid, json_values)


token_ids = st.lists(ints, min_size=0, max_size=5)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"])
content = st.one_of(
    texts, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2)
)
message = st.fixed_dictionaries({"role": field(roles)}, optional={"content": field(content), "name": json_values})
messages = st.lists(field(message), min_size=0, max_size=3)
SAMPLING = {
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 4),
    "min_tokens": st.integers(0, 3),
    "temperature": floats,
    "top_p": floats,
    "top_k": ints,
    "min_p": floats,
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
    "stop": st.one_of(texts, st.lists(texts, max_size=18)),
    "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(),
    "seed": ints,
    "priority": ints,
    "skip_special_tokens": st.booleans(),
    "logit_bias": st.dictionaries(st.one_of(ints.map(str), texts), floats, max_size=3),
    "include_stop_str_in_output": st.booleans(),
}
REPLY_SAMPLING = {k: v for k, v in SAMPLING.items() if k != "n"}
STREAM = {"stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": json_values})}
MODEL = {"model": st.just(MODEL_NAME)}
PROMPTS = st.one_of(texts, token_ids, st.lists(texts, max_size=3), st.lists(token_ids, max_size=3))
RESPONSE_IDS = ["resp_" + "0" * 24, "sess_" + "0" * 24, "nope", "%ff"]
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"x": {"enum": [1, 2]}}}}
ITEMS = st.lists(
    st.one_of(
        message,
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": texts, "name": texts, "arguments": texts}),
        st.fixed_dictionaries(
            {"type": st.just("function_call_output"), "call_id": texts, "output": st.one_of(texts, content)}
        ),
        json_values,
    ),
    max_size=3,
)
RESPONSE_FORMATS = st.one_of(
    json_values,
    st.sampled_from(
        [
            {"format": {"type": "text"}},
            {"format": {"type": "json_object"}},
            {
                "format": {
                    "type": "json_schema",
                    "name": "t",
                    "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                }
            },
        ]
    ),
)
SCHEMAS = {  # each endpoint's fields with values of the right type (numbers in or out of range)
    "completions": {
        **MODEL,
        **SAMPLING,
        **STREAM,
        "prompt": PROMPTS,
        "echo": st.booleans(),
        "logprobs": st.integers(0, 3),
        "best_of": ints,
        "suffix": json_values,
    },
    "chat": {
        **MODEL,
        **SAMPLING,
        **STREAM,
        "messages": messages,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 3),
        "max_completion_tokens": st.integers(1, 4),
        "tools": json_values,
        "response_format": json_values,
    },
    "tokenize": {
        **MODEL,
        "prompt": texts,
        "messages": messages,
        "add_special_tokens": st.booleans(),
        "add_generation_prompt": st.booleans(),
    },
    "detokenize": {**MODEL, "tokens": token_ids},
    "session create": {**MODEL, **REPLY_SAMPLING, "system": texts, "messages": messages},
    "session message": {**REPLY_SAMPLING, **STREAM, "role": roles, "content": content},
    "session edit": {"max_tokens": st.integers(1, 3), **STREAM, "role": roles, "content": content},
    "session fork": {"at": st.integers(-1, 4)},
    "session continue": {"max_tokens": st.integers(1, 3), **STREAM},
    "embeddings": {
        **MODEL,
        "input": PROMPTS,
        "encoding_format": st.sampled_from(["float", "base64", "int8"]),
        "dimensions": ints,
        "user": texts,
    },
    "responses": {
        **MODEL,
        "input": st.one_of(texts, ITEMS),
        "instructions": texts,
        "max_output_tokens": st.integers(1, 4),
        "previous_response_id": st.sampled_from(RESPONSE_IDS),
        "store": st.booleans(),
        "background": st.booleans(),
        "stream": st.booleans(),
        "temperature": floats,
        "top_p": floats,
        "tools": st.one_of(json_values, st.just([TOOL])),
        "tool_choice": st.one_of(
            json_values, st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}])
        ),
        "text": RESPONSE_FORMATS,
        "metadata": st.dictionaries(texts, texts, max_size=2),
        "include": st.lists(texts, max_size=2),
        "top_logprobs": st.integers(0, 3),
        "seed": ints,
    },
}
RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"[" * 60_000 + b"]" * 60_000,
            b'{"a": ' * 100 + b"1" + b"}" * 100,
            b'{"n": ' + b"9" * 5000 + b"}",
            b'{"temperature": NaN}',
            b'{"top_p": -Infinity}',
            b"\xff\xfe{}",
            b'{"prompt": "\\ud800"}',
            b"",
            b"null",
            b"[]",
            b'"x"',
            b"1e999",
            b'{"prompt": "a",',
            b'{"prompt": "a"}' * 2,
        ]
    ),
)
KEYS = st.sampled_from([FUZZ_KEY] * 6 + [None, "wrong", "Bearer", b"Bearer \xff\xfe", b"\xc3\x28"])
SESSION_IDS = ["sess_" + "0" * 24, "nope", "%ff", "sess_%00"]

ENDPOINTS = {
    # name: (method, path template, schema or None for no body)
    "completions": ("POST", "/v1/completions", "completions"),
    "chat": ("POST", "/v1/chat/completions", "chat"),
    "tokenize": ("POST", "/tokenize", "tokenize"),
    "detokenize": ("POST", "/detokenize", "detokenize"),
    "models": ("GET", "/v1/models", None),
    "model": ("GET", "/v1/models/{model}", None),
    "session create": ("POST", "/v1/sessions", "session create"),
    "session list": ("GET", "/v1/sessions", None),
    "session get": ("GET", "/v1/sessions/{sid}", None),
    "session message": ("POST", "/v1/sessions/{sid}/messages", "session message"),
    "session edit": ("PUT", "/v1/sessions/{sid}/messages/{index}", "session edit"),
    "session fork": ("POST", "/v1/sessions/{sid}/fork", "session fork"),
    "session continue": ("POST", "/v1/sessions/{sid}/continue", "session continue"),
    "session cancel": ("POST", "/v1/sessions/{sid}/cancel", None),
    "session delete": ("DELETE", "/v1/sessions/{sid}", None),
    "embeddings": ("POST", "/v1/embeddings", "embeddings"),
    "responses": ("POST", "/v1/responses", "responses"),
    "response get": ("GET", "/v1/responses/{rid}", None),
    "response items": ("GET", "/v1/responses/{rid}/input_items{query}", None),
    "response cancel": ("POST", "/v1/responses/{rid}/cancel", None),
    "response delete": ("DELETE", "/v1/responses/{rid}", None),
    "tokenizer info": ("GET", "/tokenizer_info", None),
    "openapi": ("GET", "/openapi.json", None),
    "health": ("GET", "/health", None),
    "metrics": ("GET", "/metrics", None),
}


def body_for(schema: str | None) -> st.SearchStrategy:
    """A body for the endpoint: valid fields; valid fields with one of them replaced by any JSON
    value (each refusal path gets reached, not just the first check); unknown fields; any JSON
    value; raw bytes."""
    if schema is None:
        return st.one_of(st.none(), RAW_BODIES)
    fields = SCHEMAS[schema]
    shaped = st.fixed_dictionaries({}, optional=fields)
    mutated = st.builds(lambda b, name, value: {**b, name: value}, shaped, st.sampled_from(sorted(fields)), json_values)
    with_unknown = st.builds(lambda b, extra: {**b, **extra}, shaped, st.dictionaries(texts, json_values, max_size=2))
    return st.one_of(shaped, mutated, mutated, with_unknown, json_values, RAW_BODIES)


@pytest.fixture(scope="module")
def fuzz_server(async_engine):
    srv = start_server(async_engine, api_keys=(FUZZ_KEY,), max_sessions_per_key=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def live_response(fuzz_server):
    """A stored response, made again whenever the fuzz deleted it."""
    made: list[str] = []

    def get() -> str:
        if made and send(fuzz_server, "GET", f"/v1/responses/{made[-1]}", key=FUZZ_KEY).status == 200:
            return made[-1]
        created = send(fuzz_server, "POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2}, key=FUZZ_KEY)
        assert created.status == 200, created.text
        made.append(created.json["id"])
        return made[-1]

    return get


@pytest.fixture(scope="module")
def live_session(fuzz_server):
    """A session with a few messages, recreated whenever the fuzz deleted it."""

    def get() -> str:
        listed = send(fuzz_server, "GET", "/v1/sessions", key=FUZZ_KEY).json["data"]
        if listed:
            return listed[0]["id"]
        created = send(fuzz_server, "POST", "/v1/sessions", {"system": "Be brief.", "max_tokens": 2}, key=FUZZ_KEY)
        assert created.status == 200, created.text
        sid = created.json["id"]
        send(fuzz_server, "POST", f"/v1/sessions/{sid}/messages", {"content": "Hi"}, key=FUZZ_KEY)
        return sid

    return get


def check_response(endpoint: str, reply) -> None:
    STATUSES[endpoint, reply.status] += 1
    assert reply.status < 500, (endpoint, reply.status, reply.text[:500])
    assert "Traceback" not in reply.text
    if reply.status >= 400:
        error = json.loads(reply.text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        assert error["type"] != "server_error"
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(reply.text)
        assert events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and e.get("error", {}).get("type") == "server_error" for e in events)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@FUZZ
@given(data=st.data())
def test_no_input_gets_a_5xx(fuzz_server, live_session, live_response, endpoint, data):
    method, template, schema = ENDPOINTS[endpoint]
    path = template.format(
        model=data.draw(st.sampled_from([MODEL_NAME, "gpt-17", "%ff"])),
        sid=data.draw(st.sampled_from([live_session(), *SESSION_IDS])) if "{sid}" in template else "",
        rid=data.draw(st.sampled_from([live_response(), *RESPONSE_IDS])) if "{rid}" in template else "",
        index=data.draw(st.sampled_from(["0", "1", "2", "-1", "x", "9" * 5000])) if "{index}" in template else "",
        query=data.draw(
            st.sampled_from(
                [
                    "",
                    "?limit=2&order=asc",
                    "?limit=0",
                    "?limit=x",
                    "?order=sideways",
                    "?after=nope",
                    "?before=%ff&limit=999",
                ]
            )
        )
        if "{query}" in template
        else "",
    )
    body = data.draw(body_for(schema))
    key = data.draw(KEYS)
    headers = {"Authorization": key} if isinstance(key, bytes) else None
    kwargs = dict(key=key if isinstance(key, str) else None, headers=headers, timeout=60)
    if isinstance(body, bytes):
        reply = send(fuzz_server, method, path, raw=body, **kwargs)
    else:
        reply = send(fuzz_server, method, path, raw=json.dumps(body).encode() if body is not None else None, **kwargs)
    check_response(endpoint, reply)


def test_after_the_fuzz_the_engine_serves_and_its_pool_is_idle(fuzz_server, async_engine):
    total = sum(STATUSES.values())
    errors_5xx = sum(n for (_, status), n in STATUSES.items() if status >= 500)
    by_status = collections.Counter()
    for (_, status), n in STATUSES.items():
        by_status[status] += n
    print(
        f"\nfuzz: {total} requests over {len({e for e, _ in STATUSES})} endpoints, {errors_5xx} 5xx; "
        f"statuses {dict(sorted(by_status.items()))}"
    )
    assert total >= EXAMPLES_PER_ENDPOINT * len(ENDPOINTS) and errors_5xx == 0
    assert_serving_and_idle(fuzz_server, async_engine, FUZZ_KEY)
