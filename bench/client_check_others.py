"""The checks of `bench.client_checks` for the `anthropic` SDK, the OpenAI Agents SDK, langchain-openai
and litellm (see `client_check_common.py`)."""

from __future__ import annotations

import asyncio

from client_check_common import (
    ASK_WEATHER,
    BASE,
    CITY_SCHEMA,
    FORCED,
    KEY,
    MODEL,
    SHORT,
    WEATHER_TOOL,
    check,
    city_only,
    run_checks,
)

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
    city_only(use.input)
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
    city_only(message.tool_calls[0]["args"])


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
    city_only(reply.choices[0].message.tool_calls[0].function.arguments)


if __name__ == "__main__":
    run_checks()
