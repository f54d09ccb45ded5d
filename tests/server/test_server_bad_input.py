"""Table-driven bad input: exact status codes, OpenAI's error shape, never a 500 or a traceback."""

from __future__ import annotations

import json

import pytest
from server_harness import MODEL_NAME, send

MSGS = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
UNKNOWN_SESSION = "/v1/sessions/sess_000000000000000000000000"


def chat(**fields):
    return {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 2, **fields}


def comp(**fields):
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}


# (name, method, path, JSON body or raw bytes, status, error code or None, param or None)
CASES = [
    ("malformed json", "POST", CHAT, b'{"model": "tiny-random", "messages": [', 400, None, None),
    ("not utf-8", "POST", CHAT, b"\xff\xfe{}", 400, None, None),
    ("empty body", "POST", CHAT, b"", 400, None, None),
    ("json array body", "POST", CHAT, b"[1, 2]", 400, None, None),
    ("json string body", "POST", COMP, b'"hello"', 400, None, None),
    ("messages missing", "POST", CHAT, {"model": MODEL_NAME}, 400, None, "messages"),
    ("messages not a list", "POST", CHAT, chat(messages="Hello"), 400, None, "messages"),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400, None, "messages"),
    ("message not an object", "POST", CHAT, chat(messages=["Hello"]), 400, None, "messages"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, None, "messages"),
    ("content a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, None, "messages"),
    (
        "image content part",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        None,
        "messages",
    ),
    ("temperature a string", "POST", CHAT, chat(temperature="hot"), 400, None, "temperature"),
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="10"), 400, None, "max_tokens"),
    ("n a float", "POST", CHAT, chat(n=1.5), 400, None, "n"),
    ("n a bool", "POST", CHAT, chat(n=True), 400, None, "n"),
    ("stream a string", "POST", CHAT, chat(stream="yes"), 400, None, "stream"),
    ("stop a number", "POST", CHAT, chat(stop=5), 400, None, "stop"),
    ("stop empty string", "POST", CHAT, chat(stop=[""]), 400, None, "stop"),
    ("seed a string", "POST", CHAT, chat(seed="1"), 400, None, "seed"),
    ("negative max_tokens", "POST", CHAT, chat(max_tokens=-1), 400, None, "max_tokens"),
    ("zero max_completion_tokens", "POST", CHAT, chat(max_completion_tokens=0), 400, None, "max_completion_tokens"),
    ("huge max_tokens", "POST", CHAT, chat(max_tokens=10**12), 400, None, "max_tokens"),
    ("n zero", "POST", CHAT, chat(n=0), 400, None, "n"),
    ("huge n", "POST", CHAT, chat(n=10**6), 400, None, "n"),
    ("negative temperature", "POST", CHAT, chat(temperature=-0.5), 400, None, "temperature"),
    ("top_p zero", "POST", CHAT, chat(top_p=0), 400, None, "top_p"),
    ("top_p above one", "POST", CHAT, chat(top_p=1.5), 400, None, "top_p"),
    ("presence_penalty too big", "POST", CHAT, chat(presence_penalty=5), 400, None, "presence_penalty"),
    ("huge seed", "POST", CHAT, chat(seed=2**80), 400, None, "seed"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400, None, "top_logprobs"),
    ("top_logprobs too big", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400, None, "top_logprobs"),
    ("logprobs a bool for completions", "POST", COMP, comp(logprobs=True), 400, None, "logprobs"),
    ("completion logprobs too big", "POST", COMP, comp(logprobs=21), 400, None, "logprobs"),
    ("unknown field", "POST", CHAT, chat(frobnicate=1), 400, "unknown_field", "frobnicate"),
    ("chat-only field on completions", "POST", COMP, comp(messages=MSGS), 400, "unknown_field", "messages"),
    (
        "prediction",
        "POST",
        CHAT,
        chat(prediction={"type": "content", "content": "x"}),
        400,
        "unsupported_parameter",
        "prediction",
    ),
    ("tools not a list", "POST", CHAT, chat(tools={"type": "function"}), 400, None, "tools"),
    (
        "response_format of an unknown type",
        "POST",
        CHAT,
        chat(response_format={"type": "xml"}),
        400,
        "invalid_schema",
        "response_format",
    ),
    ("logit_bias key not a token id", "POST", COMP, comp(logit_bias={"five": 10}), 400, None, "logit_bias"),
    ("logit_bias token past the vocabulary", "POST", CHAT, chat(logit_bias={"99999999": 1}), 400, None, "logit_bias"),
    ("logit_bias value out of range", "POST", CHAT, chat(logit_bias={"5": 101}), 400, None, "logit_bias"),
    ("logit_bias not an object", "POST", COMP, comp(logit_bias=[5]), 400, None, "logit_bias"),
    (
        "logit_bias too many tokens",
        "POST",
        COMP,
        comp(logit_bias={str(i): 1 for i in range(301)}),
        400,
        None,
        "logit_bias",
    ),
    ("prompt_logprobs too big", "POST", COMP, comp(prompt_logprobs=21), 400, None, "prompt_logprobs"),
    ("prompt_logprobs not an integer", "POST", CHAT, chat(prompt_logprobs="all"), 400, None, "prompt_logprobs"),
    ("echo not a boolean", "POST", COMP, comp(echo="yes"), 400, None, "echo"),
    ("best_of above n", "POST", COMP, comp(best_of=3), 400, "unsupported_parameter", "best_of"),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        None,
        "stream_options",
    ),
    ("stream_options not an object", "POST", CHAT, chat(stream=True, stream_options=True), 400, None, "stream_options"),
    ("prompt missing", "POST", COMP, {"model": MODEL_NAME}, 400, None, "prompt"),
    ("empty prompt", "POST", COMP, comp(prompt=""), 400, None, "prompt"),
    ("empty prompt list", "POST", COMP, comp(prompt=[]), 400, None, "prompt"),
    ("mixed prompt list", "POST", COMP, comp(prompt=["a", 1]), 400, None, "prompt"),
    ("too many prompts", "POST", COMP, comp(prompt=["Hello"] * 65), 400, None, "prompt"),
    ("token id out of vocab", "POST", COMP, comp(prompt=[1, 2, 10**6]), 400, None, "prompt"),
    ("negative token id", "POST", COMP, comp(prompt=[-1]), 400, None, "prompt"),
    (
        "prompt over the context",
        "POST",
        COMP,
        comp(prompt="Hello world " * 400),
        400,
        "context_length_exceeded",
        "prompt",
    ),
    (
        "chat over the context",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "Hello world " * 400}]),
        400,
        "context_length_exceeded",
        "messages",
    ),
    (
        "prompt + max_tokens over the context",
        "POST",
        COMP,
        comp(prompt=[5] * 400, max_tokens=200),
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    ("unknown model", "POST", CHAT, chat(model="gpt-17"), 404, "model_not_found", "model"),
    ("unknown model card", "GET", "/v1/models/gpt-17", None, 404, "model_not_found", None),
    ("unknown path", "GET", "/v1/nothing-here", None, 404, None, None),
    ("wrong method", "GET", CHAT, None, 405, None, None),
    ("body too large", "POST", CHAT, b'{"x": "' + b"a" * (2 << 20) + b'"}', 413, None, None),
    ("unknown session", "GET", UNKNOWN_SESSION, None, 404, "session_not_found", None),
    (
        "message to unknown session",
        "POST",
        UNKNOWN_SESSION + "/messages",
        {"content": "hi"},
        404,
        "session_not_found",
        None,
    ),
    ("fork unknown session", "POST", UNKNOWN_SESSION + "/fork", {"at": 0}, 404, "session_not_found", None),
    ("delete unknown session", "DELETE", UNKNOWN_SESSION, None, 404, "session_not_found", None),
    ("session with unknown field", "POST", "/v1/sessions", {"colour": "blue"}, 400, "unknown_field", "colour"),
    ("session with bad default", "POST", "/v1/sessions", {"temperature": -1}, 400, None, "temperature"),
    ("session system not a string", "POST", "/v1/sessions", {"system": 3}, 400, None, "system"),
    ("session for unknown model", "POST", "/v1/sessions", {"model": "gpt-17"}, 404, "model_not_found", "model"),
    # Bounds the JSON parser itself would not keep (issue 13): 400 before any field is read.
    ("json nested 60,000 deep", "POST", CHAT, b"[" * 60_000 + b"]" * 60_000, 400, "invalid_json", None),
    (
        "object nested past the limit",
        "POST",
        COMP,
        b'{"prompt": ' + b'{"a": ' * 40 + b"1" + b"}" * 41,
        400,
        "invalid_json",
        None,
    ),
    ("5,000-digit integer", "POST", CHAT, b'{"max_tokens": ' + b"9" * 5000 + b"}", 400, "invalid_json", None),
    ("NaN", "POST", CHAT, b'{"temperature": NaN}', 400, "invalid_json", None),
    ("float overflowing to infinity", "POST", CHAT, b'{"temperature": 1e999}', 400, "invalid_json", None),
    (
        "lone surrogate in chat content",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "invalid_json",
        None,
    ),
    ("lone surrogate in a prompt", "POST", COMP, b'{"prompt": "a\\udfffb"}', 400, "invalid_json", None),
    ("lone surrogate in /tokenize", "POST", "/tokenize", b'{"prompt": "\\ud83d"}', 400, "invalid_json", None),
    ("lone surrogate in a key", "POST", CHAT, b'{"\\ud800": 1}', 400, "invalid_json", None),
    ("role a list", "POST", CHAT, chat(messages=[{"role": ["user"], "content": "x"}]), 400, None, "messages"),
    (
        "message name a number",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "name": 5}]),
        400,
        None,
        "messages",
    ),
    (
        "top_k of 310 digits",
        "POST",
        COMP,
        b'{"prompt": "Hi", "top_k": 1' + b"0" * 309 + b"}",
        400,
        "invalid_json",
        None,
    ),
    ("top_k past int32", "POST", COMP, comp(top_k=2**31), 400, None, "top_k"),
    ("stop token past int32", "POST", COMP, comp(stop_token_ids=[2**31], min_tokens=1), 400, None, "stop_token_ids"),
    (
        "stop token past the vocabulary",
        "POST",
        CHAT,
        chat(stop_token_ids=[99999999], min_tokens=1),
        400,
        None,
        "stop_token_ids",
    ),
    ("too many stop strings", "POST", CHAT, chat(stop=["x"] * 17), 400, None, "stop"),
    ("stop string too long", "POST", CHAT, chat(stop=["x" * 65]), 400, None, "stop"),
    ("stop strings too long together", "POST", CHAT, chat(stop=["x" * 60] * 3), 400, None, "stop"),
    ("logit_bias key of 5,000 digits", "POST", COMP, comp(logit_bias={"9" * 5000: 1}), 400, None, "logit_bias"),
    ("priority past int32", "POST", COMP, comp(priority=-(2**31) - 1), 400, None, "priority"),
    ("temperature past float32", "POST", COMP, comp(temperature=1e39), 400, None, "temperature"),
    (
        "session message with a lone surrogate",
        "POST",
        UNKNOWN_SESSION + "/messages",
        b'{"content": "\\udc00"}',
        400,
        "invalid_json",
        None,
    ),
]

SESSION_CASES = [
    # (name, method, path under the session, body, status, code)
    ("assistant role posted", "POST", "/messages", {"role": "assistant", "content": "x"}, 400, None),
    ("message without content", "POST", "/messages", {"role": "user"}, 400, None),
    ("message with n", "POST", "/messages", {"content": "x", "n": 2}, 400, "unknown_field"),
    ("message content a list of numbers", "POST", "/messages", {"content": [1, 2]}, 400, None),
    ("edit index not a number", "PUT", "/messages/first", {"content": "x"}, 400, None),
    ("edit index out of range", "PUT", "/messages/7", {"content": "x"}, 404, "message_not_found"),
    ("edit negative index", "PUT", "/messages/-1", {"content": "x"}, 404, "message_not_found"),
    ("fork at -1", "POST", "/fork", {"at": -1}, 400, None),
    ("fork past the end", "POST", "/fork", {"at": 99}, 400, None),
    ("fork at a string", "POST", "/fork", {"at": "2"}, 400, None),
    ("continue with nothing to continue", "POST", "/continue", {}, 400, None),
    ("cancel with nothing in flight", "POST", "/cancel", None, 409, "no_reply_in_progress"),
    (
        "message over the context",
        "POST",
        "/messages",
        {"content": "Hello world " * 400},
        400,
        "context_length_exceeded",
    ),
]


def check_error_shape(reply, status):
    assert reply.status == status, reply.text
    assert "Traceback" not in reply.text
    body = reply.json
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("name,method,path,body,status,code,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_its_exact_status(server, name, method, path, body, status, code, param):
    raw = body if isinstance(body, bytes) else None
    reply = send(server, method, path, None if raw is not None else body, raw=raw)
    error = check_error_shape(reply, status)
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


@pytest.fixture(scope="module")
def session_id(server):
    reply = send(server, "POST", "/v1/sessions", {"system": "Be brief."})
    assert reply.status == 200
    yield reply.json["id"]
    send(server, "DELETE", f"/v1/sessions/{reply.json['id']}")


@pytest.mark.parametrize("name,method,path,body,status,code", SESSION_CASES, ids=[c[0] for c in SESSION_CASES])
def test_bad_session_request_gets_its_exact_status(server, session_id, name, method, path, body, status, code):
    reply = send(server, method, f"/v1/sessions/{session_id}{path}", body)
    error = check_error_shape(reply, status)
    if code is not None:
        assert error["code"] == code
    assert send(server, "GET", f"/v1/sessions/{session_id}").json["messages"] == [
        {"role": "system", "content": "Be brief."}
    ]  # a refused request changes nothing


def test_server_still_serves_after_the_bad_inputs(server):
    reply = send(server, "POST", CHAT, chat())
    assert reply.status == 200
    assert json.loads(reply.text)["choices"][0]["finish_reason"] in ("stop", "length")


def test_authorization_header_that_is_not_utf8_is_401(server):
    for value in (b"Bearer \xff\xfe\xfd", b"\xc3\x28", b"Bearer key-alpha\x80"):
        reply = send(server, "GET", "/v1/models", key=None, headers={"Authorization": value})
        assert check_error_shape(reply, 401)["code"] == "invalid_api_key"
