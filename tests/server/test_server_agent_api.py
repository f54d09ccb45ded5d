"""The agent-facing settings on the tiny-random engine: `--reasoning-parser`, `--chat-template`,
`--no-strict-schemas` from the command line; `chat_template_kwargs` reaching the template and bad
values of it refused; a deepseek_r1 split of a reply forced through `</think>` by a regex, streamed
and not, with its reasoning tokens; reasoning items sent back to the Responses API accepted, and
malformed ones refused with the API's error shape."""

from __future__ import annotations

import argparse

import pytest
from server_harness import KEY_A, MODEL_NAME, send, sse_events, start_server, wait_until_idle

from server.cli import add_server_args, server_config_from_args
from server.config import ServerConfig

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if greeting %}{{ greeting }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), reasoning_parser="deepseek_r1", chat_template=TEMPLATE)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def kv_all_free_after(thinking, async_engine, assert_kv_all_free):
    yield
    wait_until_idle(thinking, async_engine)
    thinking.engine_call(async_engine, lambda router: [assert_kv_all_free(e) for e in router.replicas])


def test_the_flags_reach_the_server_settings(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    parser = argparse.ArgumentParser()
    add_server_args(parser.add_argument_group())
    args = parser.parse_args(["--no-strict-schemas", "--reasoning-parser", "qwen3", "--chat-template", str(template)])
    config = server_config_from_args(args, "m")
    assert (config.strict_schemas, config.reasoning_parser, config.chat_template) == (False, "qwen3", TEMPLATE)
    defaults = server_config_from_args(parser.parse_args([]), "m")
    assert (defaults.strict_schemas, defaults.reasoning_parser, defaults.chat_template) == (True, None, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "nope"])
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="nope")


def chat(srv, **extra):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "temperature": 0}
    return send(srv, "POST", "/v1/chat/completions", {**body, **extra})


def test_chat_template_kwargs_reach_the_template(thinking):
    plain = chat(thinking, max_tokens=1, logprobs=True)
    greeted = chat(thinking, max_tokens=1, chat_template_kwargs={"greeting": "Sure! Here"})
    assert plain.status == greeted.status == 200
    assert greeted.json["usage"]["prompt_tokens"] > plain.json["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "value,message",
    [("x", "must be an object"), ({"messages": []}, "may not set"), ({"not a name": 1}, "must be an object")],
)
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(thinking, value, message):
    reply = chat(thinking, chat_template_kwargs=value)
    assert reply.status == 400 and reply.json["error"]["param"] == "chat_template_kwargs"
    assert message in reply.json["error"]["message"]


THOUGHT = {"guided_regex": r"[a-z]{3,8} [a-z]{3,8}</think>\n[a-z]{3,8}"}


def test_deepseek_r1_reasoning_split_streamed_and_not_with_its_token_count(thinking):
    whole = chat(thinking, **THOUGHT).json
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"].count(" ") == 1 and "</think>" not in message["reasoning_content"]
    assert message["content"].isalpha() and whole["choices"][0]["finish_reason"] == "stop"
    details = whole["usage"]["completion_tokens_details"]
    assert 0 < details["reasoning_tokens"] < whole["usage"]["completion_tokens"]
    stream = chat(thinking, **THOUGHT, stream=True, stream_options={"include_usage": True})
    events = sse_events(stream.text)
    deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert events[-2]["usage"]["completion_tokens_details"] == details  # (the last is [DONE])


def test_a_reply_that_never_closes_its_think_block_is_all_reasoning(thinking):
    reply = chat(thinking, max_tokens=8).json
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == ""
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == reply["usage"]["completion_tokens"]


def test_responses_take_reasoning_items_back_and_refuse_malformed_ones(thinking):
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]}
    body = {
        "model": MODEL_NAME,
        "input": [{"role": "user", "content": "hi"}, reasoning, {"role": "assistant", "content": "yo"}],
        "max_output_tokens": 8,
        "store": False,
        "guided_regex": "[a-z]{3,8}",
    }
    reply = send(thinking, "POST", "/v1/responses", body)
    assert reply.status == 200 and [item["type"] for item in reply.json["output"]] == ["reasoning", "message"]
    bad = send(thinking, "POST", "/v1/responses", {**body, "input": [{**reasoning, "summary": "x"}]})
    assert bad.status == 400 and bad.json["error"]["param"] == "input" and "summary" in bad.json["error"]["message"]


def test_messages_api_reasoning_is_a_thinking_block_streamed_and_not(thinking):
    import anthropic

    client = anthropic.Anthropic(base_url=thinking.base_url, api_key=KEY_A, max_retries=0, timeout=60)
    thought = {"type": "enabled", "budget_tokens": 1024}
    kw = dict(model=MODEL_NAME, max_tokens=16, thinking=thought, extra_body={"top_k": 1})  # (the SDK sends no top_k)
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Greet.", "signature": ""},
                {"type": "text", "text": "Hello!"},
            ],
        },
        {"role": "user", "content": "Tell me more."},
    ]
    whole = client.messages.create(messages=history, **kw)
    # deepseek_r1: the reply starts inside the think block, and the tiny model never closes it
    assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].thinking
    with client.messages.stream(messages=history, **kw) as stream:
        deltas = [
            e.delta.thinking for e in stream if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        ]
        streamed = stream.get_final_message()
    assert "".join(deltas) == whole.content[0].thinking and len(deltas) > 1
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert client.messages.count_tokens(model=MODEL_NAME, messages=history, thinking=thought).input_tokens > 0
