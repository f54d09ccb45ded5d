"""Anthropic's Messages API through `jaxserve router` over one `jaxserve worker` (tiny random model,
loopback), with the `anthropic` SDK: the same messages, streams, forced tool calls and token counts as
`jaxserve serve`'s stack in this process on the same engine settings; its keys (`x-api-key`) and
Anthropic's error shape at the router; the worker's KV pool all free afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic
import jax
import pytest
from child_process import free_port
from router_cluster import start_router, start_worker, wait_idle
from server_harness import KEY_A, MODEL_NAME, send, start_server

from checkpoints.tiny_random import build_tiny_random
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine

# The tool prompt takes ~330 tokens of the tiny model's byte-level vocabulary: a longer context
# than the router tests' small engine.
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=640,
    block_size=8,
    num_blocks=256,
    decode_batch_buckets=(4,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(80,),
    dtype="float32",
)
GREEDY = {"temperature": 0}
NOTE = {
    "name": "take_note",
    "input_schema": {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3]}},
        "required": ["level"],
        "additionalProperties": False,
    },
}


def _flags(config: dict) -> list[str]:
    out = []
    for name, value in config.items():
        out += [f"--{name.replace('_', '-')}", *(str(v) for v in (value if isinstance(value, tuple) else (value,)))]
    return out


def _reference():
    engine = LLMEngine(build_tiny_random(), EngineConfig(**ENGINE))
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    return start_server(async_engine, api_keys=(KEY_A,)), async_engine


@pytest.fixture(scope="module")
def pair(_compilation_cache):
    """(router endpoint, the one-process server) and the worker's port."""
    port = free_port()
    worker = start_worker(port, _flags(ENGINE), jax.config.jax_compilation_cache_dir)
    with ThreadPoolExecutor(1) as pool:  # the reference engine compiles while the worker does
        reference = pool.submit(_reference)
        worker.wait_for("worker listening", timeout=600)
        ref_server, ref_engine = reference.result()
    router, endpoint = start_router([port], "--api-key", KEY_A)
    try:
        with worker, router:
            router.wait_for("Running on", timeout=120)
            yield endpoint, ref_server, port
            router.terminate()
            worker.terminate()
            router.finish(60)
            worker.finish(60)
        assert "Traceback" not in router.output, router.output
    finally:
        ref_server.stop()
        ref_engine.shutdown()


def _conversation(server) -> dict:
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY_A, max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "Tell me"}]
    kw = dict(model=MODEL_NAME, max_tokens=12, system="Be brief.", extra_body=GREEDY)
    whole = client.messages.create(messages=ask, **kw)
    with client.messages.stream(messages=ask, stop_sequences=["e"], **kw) as stream:
        streamed = stream.get_final_message()
    forced = dict(tools=[NOTE], tool_choice={"type": "tool", "name": "take_note"})
    called = client.messages.create(messages=ask, **forced, **{**kw, "max_tokens": 40})
    result = [{"type": "tool_result", "tool_use_id": called.content[0].id, "content": "noted"}]
    round_trip = [
        *ask,
        {"role": "assistant", "content": [called.content[0].model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": result},
    ]
    answer = client.messages.create(messages=round_trip, tools=[NOTE], **kw)
    return {
        "whole": (whole.content[0].text, whole.stop_reason, whole.usage.output_tokens),
        "streamed": (streamed.content[0].text if streamed.content else "", streamed.stop_reason),
        "stop_sequence": streamed.stop_sequence,
        "called": (called.content[0].name, called.content[0].input, called.stop_reason),
        "answer": [block.model_dump(exclude={"id"}) for block in answer.content],
        "counted": client.messages.count_tokens(model=MODEL_NAME, messages=round_trip, tools=[NOTE]).input_tokens,
    }


def test_the_messages_api_through_the_router_equals_one_process(pair):
    endpoint, ref_server, port = pair
    got, expected = _conversation(endpoint), _conversation(ref_server)
    assert got == expected
    assert expected["whole"][1] == "max_tokens" and expected["called"][2] == "tool_use"
    assert expected["called"][1].keys() == {"level"}
    snap = wait_idle(port)
    assert not snap.has_unfinished and snap.kv_requests == 0 and snap.kv.used == 0, snap


def test_keys_and_errors_at_the_router(pair):
    endpoint, _, _ = pair
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert send(endpoint, "POST", "/v1/messages", body, key=None, headers={"x-api-key": KEY_A}).status == 200
    refused = send(endpoint, "POST", "/v1/messages", body, key=None, headers={"x-api-key": "wrong"})
    assert refused.status == 401 and refused.json == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "incorrect API key provided"},
    }
    image = {**body, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}
    bad = send(endpoint, "POST", "/v1/messages", image)
    assert bad.status == 400 and bad.json["error"]["type"] == "invalid_request_error"
    missing = send(endpoint, "POST", "/v1/messages", {k: v for k, v in body.items() if k != "max_tokens"})
    assert missing.status == 400 and missing.json["type"] == "error"
