"""The `openai` SDK's checks of `bench.client_checks` (see `client_check_common.py`)."""

from __future__ import annotations

import json

from client_check_common import (
    ASK_WEATHER,
    BASE,
    CITY_SCHEMA,
    FORCED,
    KEY,
    MODEL,
    PERSON,
    SHORT,
    WEATHER_TOOL,
    check,
    city_only,
    run_checks,
)

# ----- openai ------------------------------------------------------------------------------------


def _openai():
    import openai

    return openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=300)


@check("openai")
def models_list() -> None:
    assert MODEL in [m.id for m in _openai().models.list().data]


@check("openai")
def chat() -> None:
    reply = _openai().chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=SHORT)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= SHORT and reply.usage.prompt_tokens > 0


@check("openai")
def chat_stream_with_usage() -> None:
    stream = _openai().chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=SHORT, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= SHORT


@check("openai")
def chat_n_seed_stop() -> None:
    client = _openai()
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, max_tokens=SHORT, temperature=1.0, seed=7)
    first = client.chat.completions.create(n=2, **kwargs)
    again = client.chat.completions.create(n=2, **kwargs)
    assert len(first.choices) == 2 and [c.message.content for c in first.choices] == [
        c.message.content for c in again.choices
    ]
    word = (first.choices[0].message.content or "x").split()[0]
    stopped = client.chat.completions.create(stop=[word], n=1, **kwargs)
    assert word not in (stopped.choices[0].message.content or ""), "the stop string was not cut"


@check("openai")
def chat_logprobs() -> None:
    reply = _openai().chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=4, logprobs=True, top_logprobs=3, temperature=0
    )
    content = reply.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


@check("openai")
def completions_logprobs_and_stream() -> None:
    client = _openai()
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=2)
    assert reply.choices[0].text and len(reply.choices[0].logprobs.tokens) == reply.usage.completion_tokens
    streamed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, stream=True
    )
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


@check("openai")
def embeddings() -> None:
    reply = _openai().embeddings.create(model=MODEL, input=["Paris is in France.", "A dog sat."])
    assert len(reply.data) == 2 and len(reply.data[0].embedding) > 0 and reply.usage.prompt_tokens > 0


@check("openai")
def forced_tool_call() -> None:
    reply = _openai().chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice=FORCED, max_tokens=64
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason in ("tool_calls", "stop")
    city_only(call.function.arguments)


@check("openai")
def streamed_tool_call_adds_up() -> None:
    client = _openai()
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice=FORCED, temperature=0)
    whole = client.chat.completions.create(max_tokens=64, **kwargs).choices[0].message.tool_calls[0]
    first, name, arguments = None, None, ""
    for chunk in client.chat.completions.create(max_tokens=64, stream=True, **kwargs):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if first is None:
                first, name = delta, delta.function.name
            arguments += delta.function.arguments or ""
    assert first is not None and first.id and name == "get_weather", "no id and name in the first tool delta"
    assert json.loads(arguments) == json.loads(whole.function.arguments)


@check("openai")
def strict_json_schema() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = _openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=fmt,
        max_tokens=64,
    )
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@check("openai")
def parse_helper_with_pydantic() -> None:
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        country: str

    reply = _openai().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Name a city."}], response_format=City, max_tokens=64
    )
    assert isinstance(reply.choices[0].message.parsed, City)


@check("openai")
def responses_create_and_stream() -> None:
    client = _openai()
    reply = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=SHORT, store=False)
    assert reply.status in ("completed", "incomplete") and reply.output_text
    kinds, text = [], ""
    for event in client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=SHORT, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete") and text


@check("openai")
def responses_forced_function() -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": CITY_SCHEMA}
    reply = _openai().responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        store=False,
    )
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    city_only(calls[0].arguments)


@check("openai")
def errors_have_openai_types() -> None:
    import openai

    client = _openai()
    try:
        client.chat.completions.create(model="no-such-model", messages=ASK_WEATHER, max_tokens=1)
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError:
        pass
    try:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=-1)
        raise AssertionError("max_tokens=-1 was accepted")
    except openai.BadRequestError:
        pass


if __name__ == "__main__":
    run_checks()
