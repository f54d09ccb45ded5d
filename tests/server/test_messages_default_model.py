"""Anthropic's Messages API on the real default model (SmolLM2-135M-Instruct), through the official
`anthropic` SDK: a sensible answer; the stream's event order, and its text, stop reason and usage equal
to the reply not streamed (greedy), with `client.messages.stream` and `stream=True`; the prompt equal to
chat completions' prompt of the same conversation (same greedy text, count_tokens equal to its
prompt tokens), tools and a tool_result round trip included; a forced tool call; stop sequences; a
prefilled assistant turn; bad input answered with Anthropic's errors. The KV pool is all free after each test."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_harness import ServerThread, running_engine, wait_until_idle

from checkpoints.registry import DEFAULT_MODEL
from jaxserve.config import EngineConfig
from server.app import build_app
from server.config import ServerConfig

pytestmark = pytest.mark.integration

KEY = "k"
GREEDY = {"temperature": 0}  # the SDK 2.x has no temperature argument: sent as an extra field
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]},
}


@pytest.fixture(scope="module")
def smol_engine():
    config = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
        block_size=16,
        num_blocks=128,
        decode_batch_buckets=(4,),
        prefill_token_buckets=(64,),
        prefill_seq_buckets=(4,),
        block_table_buckets=(32,),
    )
    with running_engine(DEFAULT_MODEL, config) as async_engine:
        yield async_engine


@pytest.fixture(scope="module")
def smol_server(smol_engine):
    srv = ServerThread(build_app(smol_engine, ServerConfig(served_model_name=DEFAULT_MODEL, api_keys=(KEY,))))
    yield srv
    srv.stop()


@pytest.fixture
def client(smol_server, smol_engine, assert_kv_all_free):
    yield anthropic.Anthropic(base_url=smol_server.base_url, api_key=KEY, max_retries=0, timeout=300)
    wait_until_idle(smol_server, smol_engine)
    smol_server.engine_call(smol_engine, lambda router: [assert_kv_all_free(e) for e in router.replicas])


@pytest.fixture
def chat(smol_server):
    return openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _raw_events(client, **kw) -> list:
    return list(client.messages.create(model=DEFAULT_MODEL, stream=True, extra_body=GREEDY, **kw))


def _check_event_order(events) -> None:
    """message_start, then blocks each opened, filled and closed in index order, then message_delta
    and message_stop (the SDK drops `ping` events)."""
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    index = -1
    for event in events[1:-2]:
        if event.type == "content_block_start":
            index += 1
            assert event.index == index
        else:
            assert event.type in ("content_block_delta", "content_block_stop") and event.index == index
    assert types.count("content_block_start") == types.count("content_block_stop")


def test_create_answers_and_both_streams_give_the_same_message(client):
    kw = dict(model=DEFAULT_MODEL, max_tokens=12, system="You are a helpful assistant.", messages=QUESTION)
    full = client.messages.create(extra_body=GREEDY, **kw)
    assert full.type == "message" and full.role == "assistant" and full.model == DEFAULT_MODEL
    assert full.id.startswith("msg_") and [b.type for b in full.content] == ["text"]
    assert "Paris" in full.content[0].text
    assert full.stop_reason == "end_turn" and full.stop_sequence is None
    assert 0 < full.usage.output_tokens <= 12

    with client.messages.stream(extra_body=GREEDY, **kw) as stream:
        assert "".join(stream.text_stream) == full.content[0].text
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text and final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == full.usage.input_tokens + (
        full.usage.cache_read_input_tokens or 0
    )

    events = _raw_events(client, **{k: v for k, v in kw.items() if k != "model"})
    _check_event_order(events)
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert events[1].content_block.type == "text" and events[1].content_block.text == ""
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert all(d.type == "text_delta" for d in deltas) and "".join(d.text for d in deltas) == full.content[0].text
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == full.usage.output_tokens


def test_the_prompt_is_chat_completions_prompt_and_count_tokens_counts_it(client, chat):
    system = "You are a geography teacher. Answer in one short sentence."
    reply = client.messages.create(
        model=DEFAULT_MODEL, max_tokens=24, system=[{"type": "text", "text": system}], messages=QUESTION
    )  # sampled (temperature 1 by default): only its usage is compared
    counted = client.messages.count_tokens(
        model=DEFAULT_MODEL, system=[{"type": "text", "text": system}], messages=QUESTION
    )
    completion = chat.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "system", "content": system}, *QUESTION], max_tokens=24, temperature=0
    )
    assert counted.input_tokens == completion.usage.prompt_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens
    greedy = client.messages.create(
        model=DEFAULT_MODEL, max_tokens=24, system=system, messages=QUESTION, extra_body=GREEDY
    )
    assert _text(greedy) == completion.choices[0].message.content
    with_tools = client.messages.count_tokens(model=DEFAULT_MODEL, messages=QUESTION, tools=[WEATHER])
    chat_with_tools = chat.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, tools=[CHAT_WEATHER], max_tokens=1, temperature=0
    )
    assert with_tools.input_tokens == chat_with_tools.usage.prompt_tokens > counted.input_tokens - 20


def test_a_forced_tool_call_and_its_result_round_trip(client, chat):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    forced = dict(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=40)
    called = client.messages.create(model=DEFAULT_MODEL, messages=ask, extra_body=GREEDY, **forced)
    assert called.stop_reason == "tool_use"
    (block,) = called.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert set(block.input) == {"city"} and "Paris" in block.input["city"]

    with client.messages.stream(model=DEFAULT_MODEL, messages=ask, extra_body=GREEDY, **forced) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds.count("input_json") > 1  # the arguments arrive piece by piece
    assert streamed.stop_reason == "tool_use" and streamed.content[0].input == block.input

    result = "18 degrees and sunny"
    conversation = [
        *ask,
        {"role": "assistant", "content": [block.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": result}]},
    ]
    answer = client.messages.create(
        model=DEFAULT_MODEL, messages=conversation, tools=[WEATHER], max_tokens=24, extra_body=GREEDY
    )
    assert answer.content and answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    arguments = json.dumps(block.input)
    chat_conversation = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": block.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": block.id, "content": result},
    ]
    same = chat.chat.completions.create(
        model=DEFAULT_MODEL, messages=chat_conversation, tools=[CHAT_WEATHER], max_tokens=24, temperature=0
    )
    assert _text(answer) == same.choices[0].message.content
    counted = client.messages.count_tokens(model=DEFAULT_MODEL, messages=conversation, tools=[WEATHER])
    assert counted.input_tokens == same.usage.prompt_tokens


def test_tool_choice_any_calls_a_tool_and_none_shows_no_tools(client):
    ask = [{"role": "user", "content": "What is the weather like in Rome?"}]
    any_tool = {"type": "any", "disable_parallel_tool_use": True}  # one call: the reply ends after it
    called = client.messages.create(
        model=DEFAULT_MODEL, messages=ask, tools=[WEATHER], tool_choice=any_tool, max_tokens=60, extra_body=GREEDY
    )
    assert called.stop_reason == "tool_use" and [b.type for b in called.content] == ["tool_use"]
    assert called.content[0].name == "get_weather" and set(called.content[0].input) == {"city"}
    events = _raw_events(client, messages=ask, tools=[WEATHER], tool_choice=any_tool, max_tokens=60)
    _check_event_order(events)
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["tool_use"]
    arguments = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(arguments) == called.content[0].input and events[-2].delta.stop_reason == "tool_use"
    plain = client.messages.count_tokens(model=DEFAULT_MODEL, messages=ask)
    none = client.messages.count_tokens(
        model=DEFAULT_MODEL, messages=ask, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert none.input_tokens == plain.input_tokens


def test_stop_sequences_end_the_reply_with_stop_sequence(client):
    kw = dict(model=DEFAULT_MODEL, max_tokens=24, messages=[{"role": "user", "content": "Name three colours."}])
    whole = _text(client.messages.create(extra_body=GREEDY, **kw))
    words = whole.split()
    assert len(words) >= 3, whole
    stop = words[2]
    cut = client.messages.create(stop_sequences=["\u2603never", stop], extra_body=GREEDY, **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == whole[: whole.index(stop)]
    events = _raw_events(client, stop_sequences=["\u2603never", stop], **{k: v for k, v in kw.items() if k != "model"})
    _check_event_order(events)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == _text(cut)
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == stop


def test_a_final_assistant_message_is_continued(client):
    prefill = "The capital of France is"
    messages = [QUESTION[0], {"role": "assistant", "content": prefill}]
    reply = client.messages.create(model=DEFAULT_MODEL, max_tokens=8, messages=messages, extra_body=GREEDY)
    assert "Paris" in _text(reply) and not _text(reply).startswith(prefill)
    with client.messages.stream(model=DEFAULT_MODEL, max_tokens=8, messages=messages, extra_body=GREEDY) as stream:
        assert stream.get_final_text() == _text(reply)


def test_with_tools_on_auto_the_stream_accumulates_to_the_reply(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris? Use your tool."}]
    kw = dict(model=DEFAULT_MODEL, max_tokens=64, tools=[WEATHER], messages=ask, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]
    assert streamed.stop_reason == whole.stop_reason and whole.content
    calls = [b for b in whole.content if b.type == "tool_use"]
    assert (whole.stop_reason == "tool_use") == bool(calls)


def test_bad_input_gets_anthropics_errors_and_never_a_500(client):
    ask = QUESTION
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}]
    unknown_id = [
        *ask,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_b", "content": "x"}]},
    ]
    long = [{"role": "user", "content": "Paris is lovely. " * 200}]
    for kw, words in (
        (dict(messages=image, max_tokens=4), "image"),
        (dict(messages=unknown_id, tools=[WEATHER], max_tokens=4), "toolu_b"),
        (dict(messages=long, max_tokens=4), "context"),
        (dict(messages=ask, max_tokens=10**9), "max_tokens"),
        (dict(messages=ask, max_tokens=500), "context"),
        (dict(messages=ask, max_tokens=4, tools=[{**WEATHER, "type": "bash_20250124"}]), "custom tools"),
    ):
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(model=DEFAULT_MODEL, **kw)
        assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "invalid_request_error"
        assert words in raised.value.body["error"]["message"], raised.value.body
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", messages=ask, max_tokens=4)
