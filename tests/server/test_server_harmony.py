"""gpt-oss's harmony replies served: a tiny random gpt-oss whose tokenizer has harmony's special
tokens and whose chat template writes harmony, its replies forced into channels by a grammar (a
random model writes none by itself). Chat completions and Responses show the analysis
channel as reasoning, the final channel as content and a commentary message to `functions.NAME` as
a call, streamed and not alike; the usage counts the reasoning tokens; `--reasoning-parser` must
fit the template; Messages may think without it. (Messages reads replies with the same `ReplyStream`.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
from server_harness import KEY_A, MODEL_NAME, TEST_ENGINE, running_engine, send, sse_events, start_server

from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from server.harmony import MESSAGE_ENDS

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", *MESSAGE_ENDS, "<|constrain|>")
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}{# <|channel|>final #}"
)
ANSWER = (
    'start: <|channel|> "analysis" <|message|> /[a-z]{3,8} [a-z]{3,8}/ <|end|>'
    ' <|start|> "assistant" <|channel|> "final" <|message|> /[a-z]{2,8}/ <|return|>'
)
CALL = (
    'start: <|channel|> "analysis" <|message|> /[a-z]{3,8}/ <|end|> <|start|> "assistant"'
    ' <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|>'
    ' "{\\"city\\": \\"" /[A-Z][a-z]{2,6}/ "\\"}" <|call|>'
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def harmony_model():
    """A tiny random gpt-oss with harmony's markers as special tokens and `<|return|>`/`<|call|>` as EOS."""
    model = build_tiny_random(family="gpt_oss", vocab_size=320)
    tokenizer = model.tokenizer_bundle.tokenizer
    tokenizer.add_special_tokens(list(HARMONY_MARKERS))
    eos = (tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>"))
    bundle = dataclasses.replace(model.tokenizer_bundle, chat_template=TEMPLATE, eos_token_ids=eos)
    config = dataclasses.replace(model.config, eos_token_ids=eos)
    return dataclasses.replace(model, tokenizer_bundle=bundle, config=config)


@pytest.fixture(scope="module")
def engine():
    with running_engine(harmony_model(), EngineConfig(**TEST_ENGINE)) as async_engine:
        yield async_engine


@pytest.fixture(scope="module")
def srv(engine):
    server = start_server(engine, api_keys=(KEY_A,), reasoning_parser="openai_gptoss")
    yield server
    server.stop()


def chat(srv, grammar, **extra):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 96}
    return send(srv, "POST", "/v1/chat/completions", {**body, "guided_grammar": grammar, "temperature": 0, **extra})


def streamed_message(srv, grammar, **extra):
    """The streamed chat reply joined back: reasoning, content, calls (name and joined arguments)."""
    reasoning, content, calls, finish = "", "", {}, None
    for event in sse_events(chat(srv, grammar, stream=True, **extra).text)[:-1]:
        choice = event["choices"][0]
        delta, finish = choice["delta"], choice["finish_reason"] or finish
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += call.get("function", {}).get("arguments") or ""
    return reasoning, content, list(calls.values()), finish


def test_analysis_is_reasoning_and_final_is_content_streamed_and_not(srv):
    reply = chat(srv, ANSWER)
    assert reply.status == 200, reply.json
    message, choice = reply.json["choices"][0]["message"], reply.json["choices"][0]
    reasoning, answer = message["reasoning_content"], message["content"]
    assert len(reasoning.split(" ")) == 2 and reasoning.replace(" ", "").isalpha() and reasoning.islower()
    assert answer.isalpha() and answer.islower() and choice["finish_reason"] == "stop"
    assert "<|" not in reasoning + answer
    # analysis header (2 tokens of markup + "analysis"), body, <|end|>: at least 5 tokens, not the answer's
    usage = reply.json["usage"]
    assert 5 <= usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
    assert streamed_message(srv, ANSWER) == (reasoning, answer, [], "stop")


def test_a_commentary_message_to_a_function_is_a_tool_call_streamed_and_not(srv):
    reply = chat(srv, CALL, tools=[WEATHER])
    assert reply.status == 200, reply.json
    choice = reply.json["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    city = json.loads(call["function"]["arguments"])["city"]
    assert call["function"]["name"] == "get_weather" and city.istitle() and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"].isalpha()
    reasoning, content, calls, finish = streamed_message(srv, CALL, tools=[WEATHER])
    assert (reasoning, content, finish) == (choice["message"]["reasoning_content"], "", "tool_calls")
    assert calls == [{"name": "get_weather", "arguments": call["function"]["arguments"]}]


def test_without_tools_a_message_to_a_function_is_content(srv):
    message = chat(srv, CALL).json["choices"][0]["message"]
    assert not message.get("tool_calls") and json.loads(message["content"])["city"].istitle()


def test_responses_show_the_channels_as_a_reasoning_item_and_a_message(srv):
    body = {"model": MODEL_NAME, "input": "hi", "guided_grammar": ANSWER, "temperature": 0}
    out = send(srv, "POST", "/v1/responses", body)
    assert out.status == 200, out.json
    reasoning, message = out.json["output"]
    assert (reasoning["type"], message["type"]) == ("reasoning", "message")
    assert message["content"][0]["text"].isalpha() and "<|" not in json.dumps(out.json["output"])
    assert out.json["usage"]["output_tokens_details"]["reasoning_tokens"] >= 5


def test_the_reasoning_parser_must_fit_the_template(engine):
    with pytest.raises(ValueError, match="cannot read it"):
        start_server(engine, reasoning_parser="qwen3")
    chatml = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(ValueError, match="does not write them"):
        start_server(engine, reasoning_parser="openai_gptoss", chat_template=chatml)


def test_messages_may_think_on_a_harmony_template_without_the_flag(engine):
    server = start_server(engine)  # no --reasoning-parser: harmony's channels are read all the same
    try:
        body = {
            "model": MODEL_NAME,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
        reply = send(server, "POST", "/v1/messages", body)
        assert reply.status == 200, reply.json
        assert {b["type"] for b in reply.json["content"]} <= {"thinking", "text"}
    finally:
        server.stop()
