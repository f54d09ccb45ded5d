"""Structured output and tool calling on the real default model (SmolLM2-135M-Instruct) through
the official client: json_schema replies for 20 schemas parse and validate, streamed and not; the
grammar ends a reply by itself; tool_choice "required" always yields a valid call, a named
function that function, "auto" text or calls. All requests of a test run at once (one batch)."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest
from server_harness import ServerThread, running_engine, wait_until_idle

from checkpoints.registry import DEFAULT_MODEL
from jaxserve.config import EngineConfig
from server.app import build_app
from server.config import ServerConfig

pytestmark = pytest.mark.integration


def obj(properties: dict, required: list | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS = [
    obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"city": NAME, "country": NAME}),
    obj({"colour": {"enum": ["red", "green", "blue"]}}),
    obj({"answer": {"type": "boolean"}}),
    obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}),
    obj({"temperature": {"type": "number", "minimum": -50, "maximum": 50}, "unit": {"enum": ["C", "F"]}}),
    obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 10}, "maxItems": 4}}),
    obj({"person": obj({"first": NAME, "last": NAME})}),
    obj({"book": obj({"title": NAME, "year": {"type": "integer", "minimum": 1500, "maximum": 2025}})}),
    obj(
        {
            "point": obj(
                {
                    "x": {"type": "integer", "minimum": -10, "maximum": 10},
                    "y": {"type": "integer", "minimum": -10, "maximum": 10},
                }
            )
        }
    ),
    obj(
        {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": obj({"name": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
            }
        }
    ),
    obj({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}),
    obj({"animal": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}, "name": NAME}),
    obj(
        {
            "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]},
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        }
    ),
    obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"title": NAME, "done": {"type": "boolean"}, "priority": {"enum": [1, 2, 3]}}),
    obj(
        {
            "user": obj(
                {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "roles": {
                        "type": "array",
                        "items": {"enum": ["admin", "dev", "guest"]},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                }
            )
        }
    ),
    obj({"capital": NAME, "population": {"type": "integer", "minimum": 0, "maximum": 50000000}}),
    obj({"email": NAME, "verified": {"type": "boolean"}}, required=["email"]),
]
PROMPTS = [
    "Describe a person.",
    "Name a city.",
    "Pick a colour.",
    "Is the sky blue?",
    "Price of a book?",
    "Weather today?",
    "Tags for a photo of a beach.",
    "Some scores.",
    "A famous person.",
    "A famous book.",
    "A point on a grid.",
    "A shopping list.",
    "An HTTP response.",
    "A pet.",
    "A meeting time.",
    "A ratio.",
    "A task.",
    "A user account.",
    "The capital of France.",
    "An email address.",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": obj({"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": obj({"zone": {"type": "string", "maxLength": 20}}),
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def smol():
    config = EngineConfig(
        max_num_seqs=40,
        max_num_batched_tokens=256,
        max_model_len=512,
        block_size=16,
        num_blocks=800,
        decode_batch_buckets=(8, 40),
        prefill_token_buckets=(256,),
        sampler_row_buckets=(40,),
        prefill_seq_buckets=(8,),
        block_table_buckets=(32,),
    )
    with running_engine(DEFAULT_MODEL, config) as async_engine:
        srv = ServerThread(build_app(async_engine, ServerConfig(served_model_name=DEFAULT_MODEL, api_keys=("k",))))
        yield srv, async_engine
        srv.stop()


@pytest.fixture
def client(smol):
    return openai.OpenAI(base_url=smol[0].base_url + "/v1", api_key="k", max_retries=0, timeout=900)


@pytest.fixture(autouse=True)
def kv_all_free_after(smol, assert_kv_all_free):
    yield
    srv, async_engine = smol
    wait_until_idle(srv, async_engine)
    srv.engine_call(async_engine, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])


def all_at_once(fn, args: list) -> list:
    with concurrent.futures.ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


def test_twenty_json_schemas_parse_and_validate_streamed_and_not(client):
    def ask(case):
        (schema, prompt), stream = case
        kwargs = dict(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
            max_tokens=120,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}},
        )
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            return choice.message.content, choice.finish_reason
        text, finish = "", None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish

    cases = [(case, stream) for stream in (False, True) for case in zip(SCHEMAS, PROMPTS)]
    replies = all_at_once(ask, cases)
    for ((schema, _), _), (text, finish) in zip(cases, replies):
        jsonschema.validate(json.loads(text), schema)
        assert finish == "stop"
    assert [r[0] for r in replies[:20]] == [r[0] for r in replies[20:]]  # greedy: streamed == not


def test_the_grammar_ends_the_reply_even_when_eos_is_ignored(client):
    schema = obj({"colour": {"enum": ["red", "green", "blue"]}})
    full = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "Pick a colour."}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].finish_reason == "stop" and full.usage.completion_tokens < 20
    jsonschema.validate(json.loads(full.choices[0].message.content), schema)


def check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_named_and_auto(client):
    def ask(case):
        tool_choice, seed, stream = case
        kwargs = dict(
            model=DEFAULT_MODEL,
            messages=ASK,
            max_tokens=100,
            temperature=0 if seed is None else 0.8,
            seed=seed,
            tools=[WEATHER, TIME],
            tool_choice=tool_choice,
        )
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            return choice.message.content, choice.message.tool_calls, choice.finish_reason
        calls, finish = {}, None  # by index: the first delta (id, type, name), arguments joined onto it
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    if d.index in calls:
                        calls[d.index].function.arguments += d.function.arguments
                    else:
                        calls[d.index] = d
                finish = c.finish_reason or finish
        return None, list(calls.values()), finish

    named = {"type": "function", "function": {"name": "get_time"}}
    cases = (
        [("required", seed, False) for seed in (None, 1, 2, 3, 4, 5)]
        + [("required", None, True)]
        + [(named, None, False), (named, 7, True), ("auto", None, False), ("auto", 3, False)]
    )
    for (choice, _, _), (content, calls, finish) in zip(cases, all_at_once(ask, cases)):
        if choice == "auto":
            assert content or calls
            if calls:
                check_calls(calls, {"get_weather", "get_time"})
            continue
        assert finish == ("stop" if choice is named else "tool_calls")  # OpenAI's finish reasons
        check_calls(calls, {"get_time"} if choice is named else {"get_weather", "get_time"})
