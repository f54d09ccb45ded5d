"""The server on the real default model (SmolLM2-135M-Instruct): a sensible answer through the
official client, stream == non-stream, a session's second turn served from the cache, the greedy
text of a chain of responses equal to the chat completion of the same conversation, and
embeddings equal to transformers' pooled hidden states (tests/data/smollm2_embeddings.json)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import openai
import pytest
from server_harness import ServerThread, delete_stored_responses, running_engine, send

from checkpoints.registry import DEFAULT_MODEL
from jaxserve.config import EngineConfig
from server.app import build_app
from server.config import ServerConfig

pytestmark = pytest.mark.integration

BLOCK = 16


@pytest.fixture(scope="module")
def smol_engine():
    config = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=BLOCK,
        num_blocks=128,
        decode_batch_buckets=(4,),
        prefill_token_buckets=(64,),
        prefill_seq_buckets=(4,),
        block_table_buckets=(16,),
    )
    with running_engine(DEFAULT_MODEL, config) as async_engine:
        yield async_engine


@pytest.fixture(scope="module")
def smol_server(smol_engine):
    srv = ServerThread(build_app(smol_engine, ServerConfig(served_model_name=DEFAULT_MODEL, api_keys=("k",))))
    yield srv
    srv.stop()


def test_default_model_answers_and_streams_the_same_text(smol_server):
    client = openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="k", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    full = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=DEFAULT_MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
        )
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


def test_a_responses_greedy_text_equals_the_chat_completion_of_its_conversation(smol_server):
    client = openai.OpenAI(base_url=smol_server.base_url + "/v1", api_key="k", max_retries=0, timeout=120)
    system = "You are a geography teacher. Answer in one short sentence."
    kw = dict(model=DEFAULT_MODEL, instructions=system, max_output_tokens=24, temperature=0)
    chat_kw = dict(model=DEFAULT_MODEL, max_tokens=24, temperature=0)
    messages = [{"role": "system", "content": system}]
    previous = None
    for question in ("What is the capital of Italy?", "And of Spain?"):
        response = client.responses.create(input=question, previous_response_id=previous, **kw)
        messages.append({"role": "user", "content": question})
        chat = client.chat.completions.create(messages=messages, **chat_kw)
        assert response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        messages.append({"role": "assistant", "content": response.output_text})
        previous = response.id
    assert "Madrid" in response.output_text
    assert response.usage.input_tokens_details.cached_tokens > 0
    delete_stored_responses(smol_server)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooled_hidden_states(smol_engine, pooling):
    reference = json.loads((Path(__file__).parents[1] / "data" / "smollm2_embeddings.json").read_text())["texts"]
    srv = ServerThread(build_app(smol_engine, ServerConfig(served_model_name=DEFAULT_MODEL, embedding_pooling=pooling)))
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        texts = [r["text"] for r in reference]  # one of ~100 tokens takes two prefill steps of 64
        assert [send(srv, "POST", "/tokenize", {"prompt": t}, key=None).json["tokens"] for t in texts] == [
            r["ids"] for r in reference
        ]
        for _ in range(2):  # the second time, last-token pooling finds the prompts in the prefix cache
            got = client.embeddings.create(model=DEFAULT_MODEL, input=texts)
            for item, ref in zip(got.data, reference):
                np.testing.assert_allclose(item.embedding, ref[pooling], atol=1e-4)
        assert got.usage.prompt_tokens == sum(len(r["ids"]) for r in reference)
    finally:
        srv.stop()
