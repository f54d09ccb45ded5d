"""The checks of `bench.client_checks`: third-party client libraries used against a running server.

Run as a script by the interpreter that has the clients (it imports no jaxserve code):

    python bench/client_check_cases.py BASE_URL MODEL API_KEY

Each check uses one library the way its documentation shows (the `openai` and `anthropic` SDKs, the
OpenAI Agents SDK, langchain-openai, litellm) and asserts what a user of that feature relies on: the
reply's shape and the values the request asked for (a forced tool's arguments in the schema's shape,
a strict JSON schema's keys, streamed fragments adding up to the whole, the API's own error types).
A library that is not installed makes its checks "skipped", never "passed". One JSON line per check
goes to stdout: {"client", "check", "status": "passed" | "failed" | "skipped", "detail", "seconds"}.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from collections.abc import Callable

BASE, MODEL, KEY = sys.argv[1:4] if len(sys.argv) >= 4 else ("", "", "")
SHORT = 16  # generated tokens where the content does not matter
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}  # the get_weather: no additionalProperties, so strict by default
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": CITY_SCHEMA},
}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

CHECKS: list[tuple[str, str, Callable[[], None]]] = []


def check(client: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        CHECKS.append((client, fn.__name__, fn))
        return fn

    return register


def _city_only(arguments: str | dict) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert set(args) == {"city"} and isinstance(args["city"], str), f"arguments {args!r} are not {{'city': str}}"


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
    _city_only(call.function.arguments)


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
    _city_only(calls[0].arguments)


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


# ----- anthropic ---------------------------------------------------------------------------------


def _anthropic():
    import anthropic

    return anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=300)


@check("anthropic")
def messages_create() -> None:
    reply = _anthropic().messages.create(
        model=MODEL, max_tokens=SHORT, system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    assert reply.role == "assistant" and reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens <= SHORT


@check("anthropic")
def messages_stream() -> None:
    with _anthropic().messages.stream(
        model=MODEL, max_tokens=SHORT, messages=[{"role": "user", "content": "Hello"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text


@check("anthropic")
def tool_use_round_trip() -> None:
    client = _anthropic()
    tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY_SCHEMA}
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.messages.create(
        model=MODEL, max_tokens=64, messages=[ask], tools=[tool], tool_choice={"type": "tool", "name": "get_weather"}
    )
    use = next(b for b in first.content if b.type == "tool_use")
    assert first.stop_reason == "tool_use" and use.name == "get_weather"
    _city_only(use.input)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}
    second = client.messages.create(
        model=MODEL,
        max_tokens=SHORT,
        tools=[tool],
        messages=[ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}],
    )
    assert second.content and second.usage.input_tokens > first.usage.input_tokens


@check("anthropic")
def count_tokens_and_errors() -> None:
    import anthropic

    client = _anthropic()
    count = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hello there"}])
    assert count.input_tokens > 0
    try:
        client.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [{"type": "nonsense"}]}]
        )
        raise AssertionError("an unknown content block type was accepted")
    except anthropic.BadRequestError as e:
        assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error"


# ----- the OpenAI Agents SDK ---------------------------------------------------------------------


@check("openai-agents")
def agent_calls_a_tool() -> None:
    from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return "Sunny, 21 C."

    provider = OpenAIProvider(openai_client=AsyncOpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0))
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=MODEL,
        model_settings=ModelSettings(tool_choice="required", max_tokens=64),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", run_config=RunConfig(model_provider=provider)))
    assert called and result.final_output == "Sunny, 21 C."


# ----- langchain-openai --------------------------------------------------------------------------


def _chat_openai(**kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=BASE + "/v1", api_key=KEY, max_retries=0, **kwargs)


@check("langchain-openai")
def langchain_invoke_and_stream() -> None:
    llm = _chat_openai(max_tokens=SHORT, temperature=0)
    whole = llm.invoke("Say hello.").content
    assert whole and "".join(chunk.content for chunk in llm.stream("Say hello.")) == whole


@check("langchain-openai")
def langchain_bind_tools_forced() -> None:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    message = (
        _chat_openai(max_tokens=64)
        .bind_tools([get_weather], tool_choice="get_weather")
        .invoke("What is the weather in Paris?")
    )
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    _city_only(message.tool_calls[0]["args"])


@check("langchain-openai")
def langchain_structured_output() -> None:
    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int

    person = _chat_openai(max_tokens=64).with_structured_output(Person, method="json_schema").invoke("Invent a person.")
    assert isinstance(person, Person)


@check("langchain-openai")
def langchain_embeddings() -> None:
    from langchain_openai import OpenAIEmbeddings

    # Not an OpenAI model: send the texts, not tiktoken's ids (langchain's documented setting for other servers).
    embedder = OpenAIEmbeddings(
        model=MODEL, base_url=BASE + "/v1", api_key=KEY, check_embedding_ctx_length=False, max_retries=0
    )
    vectors = embedder.embed_documents(["Paris is in France.", "A dog sat."])
    assert len(vectors) == 2 and len(vectors[0]) == len(embedder.embed_query("Paris"))


# ----- litellm -----------------------------------------------------------------------------------


@check("litellm")
def litellm_completion_and_stream() -> None:
    import litellm

    kwargs = dict(model=f"openai/{MODEL}", api_base=BASE + "/v1", api_key=KEY, messages=ASK_WEATHER, max_tokens=SHORT)
    reply = litellm.completion(temperature=0, **kwargs)
    text = reply.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in litellm.completion(stream=True, temperature=0, **kwargs)
    )
    assert text and streamed == text


@check("litellm")
def litellm_tool_call() -> None:
    import litellm

    reply = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=BASE + "/v1",
        api_key=KEY,
        messages=ASK_WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice=FORCED,
        max_tokens=64,
    )
    _city_only(reply.choices[0].message.tool_calls[0].function.arguments)


MODULES = {
    "openai": "openai",
    "anthropic": "anthropic",
    "openai-agents": "agents",
    "langchain-openai": "langchain_openai",
    "litellm": "litellm",
}


def main() -> None:
    for client, name, fn in CHECKS:
        start = time.perf_counter()
        if importlib.util.find_spec(MODULES[client]) is None:
            status, detail = "skipped", f"{client} is not installed in {sys.executable}"
        else:
            try:
                fn()
                status, detail = "passed", ""
            except Exception as e:  # a check's failure, whatever the library raised
                status = "failed"
                detail = f"{type(e).__name__}: {e}"[:400]
        seconds = round(time.perf_counter() - start, 2)
        print(json.dumps({"client": client, "check": name, "status": status, "detail": detail, "seconds": seconds}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
