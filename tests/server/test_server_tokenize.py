"""`/tokenize` and `/detokenize` count tokens exactly as generation does (vLLM's shapes)."""

from __future__ import annotations

import pytest

from server_harness import MODEL_NAME, send

TEXT = "The quick brown fox jumps over the lazy dog. 你好!"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def ok(reply):
    assert reply.status == 200, reply.text
    return reply.json


def test_tokenize_counts_what_generation_bills(server):
    by_prompt = ok(send(server, "POST", "/tokenize", {"model": MODEL_NAME, "prompt": TEXT}))
    completion = ok(send(server, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": TEXT, "max_tokens": 1}))
    assert by_prompt["count"] == len(by_prompt["tokens"]) == completion["usage"]["prompt_tokens"]
    assert by_prompt["max_model_len"] > by_prompt["count"]
    by_chat = ok(send(server, "POST", "/tokenize", {"messages": MESSAGES}))
    chat = ok(send(server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}))
    assert by_chat["count"] == chat["usage"]["prompt_tokens"]


def test_detokenize_inverts_tokenize(server):
    tokens = ok(send(server, "POST", "/tokenize", {"prompt": TEXT}))["tokens"]
    assert ok(send(server, "POST", "/detokenize", {"tokens": tokens})) == {"prompt": TEXT}
    assert ok(send(server, "POST", "/detokenize", {"tokens": []})) == {"prompt": ""}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt"),
    ("/tokenize", {"prompt": TEXT, "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": TEXT, "colour": "blue"}, "colour"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
])
def test_bad_input_names_the_field(server, path, body, param):
    reply = send(server, "POST", path, body)
    assert reply.status == 400 and reply.json["error"]["param"] == param, reply.text


def test_tokenize_needs_a_key_and_knows_the_model(server):
    assert send(server, "POST", "/tokenize", {"prompt": TEXT}, key=None).status == 401
    assert send(server, "POST", "/tokenize", {"model": "gpt-17", "prompt": TEXT}).status == 404
