"""`/tokenize` and `/detokenize` count tokens exactly as generation does (vLLM's shapes);
`/tokenizer_info` gives what lm-eval's remote tokenizer reads."""

from __future__ import annotations

import jinja2
import pytest
from server_harness import MODEL_NAME, send

from server.state import STATE

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


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": [1, 2]}, "prompt"),
        ("/tokenize", {"prompt": TEXT, "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": TEXT, "colour": "blue"}, "colour"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
    ],
)
def test_bad_input_names_the_field(server, path, body, param):
    reply = send(server, "POST", path, body)
    assert reply.status == 400 and reply.json["error"]["param"] == param, reply.text


def test_tokenize_needs_a_key_and_knows_the_model(server):
    assert send(server, "POST", "/tokenize", {"prompt": TEXT}, key=None).status == 401
    assert send(server, "POST", "/tokenize", {"model": "gpt-17", "prompt": TEXT}).status == 404


def test_tokenizer_info_serves_what_a_remote_tokenizer_reads(server):
    """lm-eval's `tokenizer_backend=remote`: the special tokens (their ids through /tokenize) and the
    chat template, which renders as the server renders chats."""
    info = ok(send(server, "GET", "/tokenizer_info"))
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["model_max_length"] > 0
    tokenizer = server.app[STATE].info.tokenizer
    eos = ok(send(server, "POST", "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}))["tokens"]
    assert eos[0] in tokenizer.eos_token_ids
    assert info["add_bos_token"] == (tokenizer.encode("a", add_special_tokens=True)[0] == tokenizer.bos_token_id)
    rendered = (
        jinja2.Environment()
        .from_string(info["chat_template"])
        .render(
            messages=MESSAGES,
            add_generation_prompt=True,
            **{k: info[k] for k in ("bos_token", "eos_token") if k in info},
        )
    )
    assert (
        ok(send(server, "POST", "/tokenize", {"prompt": rendered, "add_special_tokens": False}))["tokens"]
        == ok(send(server, "POST", "/tokenize", {"messages": MESSAGES}))["tokens"]
    )
    assert send(server, "GET", "/tokenizer_info", key=None).status == 401
