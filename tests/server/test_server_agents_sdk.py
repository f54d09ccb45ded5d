"""The OpenAI Agents SDK's default model (`OpenAIResponsesModel`, the Responses API) runs an agent with
one function tool against the server (tiny random model): the first turn must call the tool
(`tool_choice="required"`, enforced with structured output), the SDK runs it and sends its output
back as a `function_call_output` item, and the next turn (tool choice reset to auto, as the SDK
does after a tool call) gives the final output in the agent's output type (`text.format`), which
keeps a random model's reply short and whole."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Literal

import pytest
from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, function_tool
from openai import AsyncOpenAI
from server_harness import KEY_A, MODEL_NAME, TEST_ENGINE, delete_stored_responses, start_server, wait_until_idle

from checkpoints.tiny_random import build_tiny_random
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine

# The SDK's tool schemas and the tool-call format in the system message take ~600 tokens of the tiny
# model's byte-level vocabulary: an engine with its whole context (2,048).
LONG_ENGINE = dict(TEST_ENGINE, max_model_len=2048, num_blocks=1024, block_table_buckets=(256,))


@pytest.fixture(scope="module")
def long_engine():
    engine = LLMEngine(build_tiny_random(), EngineConfig(**LONG_ENGINE))
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


@pytest.fixture
def server(long_engine, assert_kv_all_free):
    srv = start_server(long_engine, api_keys=(KEY_A,))
    yield srv
    delete_stored_responses(srv)
    wait_until_idle(srv, long_engine)
    srv.engine_call(long_engine, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])
    srv.stop()


@dataclasses.dataclass
class Forecast:
    sky: Literal["sunny", "rainy"]


def test_an_agent_calls_its_function_tool_and_answers(server):
    calls: list[str] = []

    @function_tool
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"18 degrees and sunny in {city}"

    agent = Agent(
        name="forecaster",
        instructions="Answer with the weather.",
        model=MODEL_NAME,
        tools=[weather],
        output_type=Forecast,
        model_settings=ModelSettings(tool_choice="required", temperature=0),
    )

    async def run() -> object:
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
        try:
            return await Runner.run(agent, "What is the weather in Paris?", run_config=config, max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls and calls[0] in ("Paris", "Rome")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) >= 2
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)
