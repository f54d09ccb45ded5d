"""The agent-facing API on the real default model (SmolLM2-135M-Instruct) through the official
`openai` client: strict schemas by default (a forced `get_weather(city)` call holds `city` and
stops; `additionalProperties: true`, `strict: false` and `--no-strict-schemas` leave objects open),
tool calls streamed argument by argument that the client joins into the non-streamed call (chat
and Responses), and a reasoning parser splitting a think block that a chat template opens.

Four servers share one engine: strict (the default), plain (`strict_schemas=False`), thinking (a
template that opens `<think>` and `--reasoning-parser qwen3`) and raw (the same template, no
parser: the text the thinking server splits). Replies are greedy, so one request gives the same
tokens on every server whose constraint is the same."""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import ServerThread, running_engine, wait_until_idle

from checkpoints.registry import DEFAULT_MODEL
from jaxserve.config import EngineConfig
from server.app import build_app
from server.config import ServerConfig

pytestmark = pytest.mark.integration

# ChatML (the default model's) whose generation prompt opens a think block, unless the request's
# chat_template_kwargs say enable_thinking: false (then it writes an empty one, as Qwen3's does).
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}"
)
CITY = {"type": "string"}
LANGCHAIN_WEATHER = {  # what langchain's bind_tools sends for `def get_weather(city: str)`
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city.",
        "parameters": {"properties": {"city": CITY}, "required": ["city"], "type": "object"},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}},
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def servers():
    config = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        block_size=16,
        num_blocks=512,
        decode_batch_buckets=(8,),
        prefill_token_buckets=(256,),
        sampler_row_buckets=(8,),
        prefill_seq_buckets=(8,),
        block_table_buckets=(64,),
    )
    with running_engine(DEFAULT_MODEL, config) as async_engine:
        settings = {
            "strict": {},
            "plain": {"strict_schemas": False},
            "thinking": {"chat_template": THINK_TEMPLATE, "reasoning_parser": "qwen3"},
            "raw": {"chat_template": THINK_TEMPLATE},
        }
        started = {
            name: ServerThread(build_app(async_engine, ServerConfig(served_model_name=DEFAULT_MODEL, **extra)))
            for name, extra in settings.items()
        }
        yield started, async_engine
        for srv in started.values():
            srv.stop()


def client_of(servers, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=servers[0][name].base_url + "/v1", api_key="none", max_retries=0, timeout=600)


@pytest.fixture(autouse=True)
def kv_all_free_after(servers, assert_kv_all_free):
    yield
    started, async_engine = servers
    srv = started["strict"]
    wait_until_idle(srv, async_engine)
    srv.engine_call(async_engine, lambda router: [assert_kv_all_free(e) for e in router.replicas])


def forced(tool: dict, **extra) -> dict:
    name = tool["function"]["name"]
    return dict(
        model=DEFAULT_MODEL,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=60,
        temperature=0,
        **extra,
    )


def with_parameters(tool: dict, **changes) -> dict:
    function = tool["function"]
    return {**tool, "function": {**function, **changes}}


def call_of(reply) -> tuple[str, str, str]:
    (call,) = reply.choices[0].message.tool_calls
    return call.function.name, call.function.arguments, reply.choices[0].finish_reason


def test_forced_langchain_call_holds_only_its_properties_and_stops(servers):
    name, arguments, finish = call_of(client_of(servers, "strict").chat.completions.create(**forced(LANGCHAIN_WEATHER)))
    assert name == "get_weather" and finish in ("stop", "tool_calls")
    assert set(json.loads(arguments)) == {"city"} and isinstance(json.loads(arguments)["city"], str)
    # Plain JSON Schema, by the server's flag or the function's own `strict: false`: the same
    # request is not held to the listed properties, and this model writes on until max_tokens.
    plain = call_of(client_of(servers, "plain").chat.completions.create(**forced(LANGCHAIN_WEATHER)))
    opted_out = with_parameters(LANGCHAIN_WEATHER, strict=False)
    per_request = call_of(client_of(servers, "strict").chat.completions.create(**forced(opted_out)))
    for reply in (plain, per_request):
        assert reply[2] == "length" and reply[1].startswith('{"city": ') and len(reply[1]) > len(arguments)


def test_a_schema_that_allows_extras_keeps_them_open(servers):
    parameters = {**LANGCHAIN_WEATHER["function"]["parameters"], "additionalProperties": True}
    open_tool = with_parameters(LANGCHAIN_WEATHER, parameters=parameters)
    strict_reply = call_of(client_of(servers, "strict").chat.completions.create(**forced(open_tool)))
    plain_reply = call_of(client_of(servers, "plain").chat.completions.create(**forced(open_tool)))
    assert strict_reply == plain_reply  # the grammar is plain JSON Schema's, extras allowed
    assert strict_reply[2] == "length" and len(strict_reply[1]) > 40
    nested = {"type": "object", "properties": {"place": {"type": "object", "properties": {"city": CITY}}}}
    reply = client_of(servers, "strict").chat.completions.create(
        **forced(with_parameters(LANGCHAIN_WEATHER, parameters=nested))
    )
    assert set(json.loads(call_of(reply)[1])) <= {"place"}  # closed at every depth


def test_json_schema_response_formats_are_strict_unless_they_say_otherwise(servers):
    def ask(name: str, schema: dict, **spec) -> tuple[str, str]:
        reply = client_of(servers, name).chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "Which city has the best weather? Answer in JSON."}],
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, **spec}},
        )
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    schema = LANGCHAIN_WEATHER["function"]["parameters"]
    text, finish = ask("strict", schema)
    assert finish == "stop" and set(json.loads(text)) == {"city"}
    plain = ask("plain", schema)
    assert ask("strict", schema, strict=False) == plain != (text, finish)
    assert ask("strict", {**schema, "additionalProperties": True}) == plain


def streamed_calls(client: openai.OpenAI, **kwargs) -> tuple[list, list[tuple[str, str]], str]:
    """(the deltas, the calls as the client's own stream helper accumulates them, finish reason)."""
    deltas = []
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "chunk":
                deltas += [d for c in event.chunk.choices for d in c.delta.tool_calls or []]
        final = stream.get_final_completion()
    calls = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls or []]
    return deltas, calls, final.choices[0].finish_reason


@pytest.mark.parametrize("kind", ["named", "required-parallel"])
def test_the_openai_client_joins_streamed_fragments_into_the_whole_call(servers, kind):
    client = client_of(servers, "strict")
    if kind == "named":
        kwargs = forced(LANGCHAIN_WEATHER)
    else:
        kwargs = dict(forced(LANGCHAIN_WEATHER), tools=[LANGCHAIN_WEATHER, TIME], tool_choice="required")
        kwargs["messages"] = [{"role": "user", "content": "Weather in Paris and the time in Tokyo?"}]
        kwargs["max_tokens"] = 90
    whole = client.chat.completions.create(**kwargs).choices[0]
    deltas, calls, finish = streamed_calls(client, **kwargs)
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason
    for index in range(len(calls)):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].function.name == calls[index][0] and mine[0].function.arguments == ""
        assert len(mine) > 2 and all(d.function.name is None for d in mine[1:])  # then fragments


def test_responses_stream_function_call_arguments_as_they_are_written(servers):
    client = client_of(servers, "strict")
    function = LANGCHAIN_WEATHER["function"]
    kwargs = dict(
        model=DEFAULT_MODEL,
        input=ASK[0]["content"],
        tools=[{"type": "function", **function}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
        store=False,
    )
    whole = client.responses.create(**kwargs)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert set(json.loads(call.arguments)) == {"city"}
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 2 and "".join(fragments) == call.arguments
    assert types.index("response.output_item.added") < types.index("response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert (done.name, done.arguments) == ("get_weather", call.arguments)
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == [
        ("get_weather", call.arguments)
    ]


THINK_THEN_ANSWER = r"[a-z ,]{10,60}</think>\n\n[A-Z][a-z ,]{5,60}\."


def chat(client: openai.OpenAI, stream: bool, **extra):
    kwargs = dict(model=DEFAULT_MODEL, messages=ASK, max_tokens=80, temperature=0, **extra)
    if not stream:
        return client.chat.completions.create(**kwargs)
    return list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))


def test_reasoning_content_and_content_split_streamed_and_not(servers):
    raw = chat(client_of(servers, "raw"), False, extra_body={"guided_regex": THINK_THEN_ANSWER})
    text = raw.choices[0].message.content
    thought, answer = text.split("</think>")
    thinking = client_of(servers, "thinking")
    reply = chat(thinking, False, extra_body={"guided_regex": THINK_THEN_ANSWER})
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (thought, answer.lstrip())
    reasoning_tokens = reply.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < reply.usage.completion_tokens == raw.usage.completion_tokens
    chunks = chat(thinking, True, extra_body={"guided_regex": THINK_THEN_ANSWER})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = ["reasoning" if getattr(d, "reasoning_content", None) else "content" for d in deltas if d.content or
             getattr(d, "reasoning_content", None)]  # fmt: skip
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning") and kinds.count("reasoning") > 1
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer.lstrip()
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_content(servers):
    answer_only = {"guided_regex": r"[A-Z][a-z ,]{5,60}\.", "chat_template_kwargs": {"enable_thinking": False}}
    raw = chat(client_of(servers, "raw"), False, extra_body=answer_only).choices[0].message.content
    reply = chat(client_of(servers, "thinking"), False, extra_body=answer_only)
    assert reply.choices[0].message.content == raw and reply.choices[0].message.reasoning_content is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    thinking = chat(client_of(servers, "thinking"), False, extra_body={"guided_regex": r"[a-z ]{5,40}"})
    assert thinking.choices[0].message.reasoning_content and not thinking.choices[0].message.content


def test_a_tool_call_after_reasoning_is_a_call_streamed_and_not(servers):
    pattern = r'[a-z ]{10,40}</think>\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,12}"\}\}\n</tool_call>'  # noqa: E501
    kwargs = dict(tools=[LANGCHAIN_WEATHER], extra_body={"guided_regex": pattern})
    thinking = client_of(servers, "thinking")
    whole = chat(thinking, False, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.reasoning_content and not whole.message.content
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    deltas, calls, finish = streamed_calls(
        thinking, model=DEFAULT_MODEL, messages=ASK, max_tokens=80, temperature=0, **kwargs
    )
    assert calls == [("get_weather", call.function.arguments)] and finish == "tool_calls"


def test_responses_show_reasoning_items_streamed_and_not(servers):
    kwargs = dict(
        model=DEFAULT_MODEL,
        input=ASK[0]["content"],
        max_output_tokens=80,
        temperature=0,
        store=False,
        extra_body={"guided_regex": THINK_THEN_ANSWER},
    )
    thinking = client_of(servers, "thinking")
    whole = thinking.responses.create(**kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    thought = whole.output[0].content[0].text
    assert thought and whole.output_text and "</think>" not in thought + whole.output_text
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    events = list(thinking.responses.create(**kwargs, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    types = [e.type for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.done")
