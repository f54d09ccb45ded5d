"""The server on the real default model (SmolLM2-135M-Instruct): a sensible answer through the
official client, stream == non-stream, and a session's second turn served from the cache."""

from __future__ import annotations

import openai
import pytest

from checkpoints.registry import DEFAULT_MODEL
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from server.app import build_app
from server.config import ServerConfig
from server_harness import ServerThread, send

pytestmark = pytest.mark.integration

BLOCK = 16


@pytest.fixture(scope="module")
def smol_server():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, block_size=BLOCK,
                          num_blocks=128, decode_batch_buckets=(4,), prefill_token_buckets=(64,),
                          prefill_seq_buckets=(4,), block_table_buckets=(16,))
    engine = LLMEngine(DEFAULT_MODEL, config)
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    srv = ServerThread(build_app(async_engine, ServerConfig(served_model_name=DEFAULT_MODEL, api_keys=("k",))))
    yield srv
    srv.stop()
    async_engine.shutdown()


def test_default_model_answers_and_streams_the_same_text(smol_server):
    client = openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="k", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    full = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=12,
                                                    temperature=0, stream=True)
        if chunk.choices
    )
    assert streamed == text


def test_default_model_session_second_turn_reuses_the_first(smol_server):
    created = send(smol_server, "POST", "/v1/sessions", {"temperature": 0, "max_tokens": 16}, key="k").json
    path = f"/v1/sessions/{created['id']}/messages"
    first = send(smol_server, "POST", path, {"content": "Name a colour of the sky."}, key="k").json
    second = send(smol_server, "POST", path, {"content": "And of grass?"}, key="k").json
    history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (history - 1) // BLOCK * BLOCK
    assert second["usage"]["prompt_tokens"] > history
