"""The Responses API's conversations, `truncation: "auto"` and streamed background responses through
`jaxserve router` over one `jaxserve worker` (tiny random model, loopback), with the openai client
and a raw aiohttp client: the routes answer at the router as at one process, a background stream
left mid-way is resumed there and a cancel ends it; the worker's KV pool is all free afterwards."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import jax
import openai
import pytest
from router_cluster import wait_idle, worker_behind_router
from server_harness import KEY_A, MODEL_NAME, stream_events

ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=8,
    num_blocks=256,
    decode_batch_buckets=(4,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(32,),
    dtype="float32",
)
GREEDY = dict(model=MODEL_NAME, max_output_tokens=8, temperature=0)
HEADERS = {"Authorization": f"Bearer {KEY_A}"}


def _flags(config: dict) -> list[str]:
    out = []
    for name, value in config.items():
        out += [f"--{name.replace('_', '-')}", *(str(v) for v in (value if isinstance(value, tuple) else (value,)))]
    return out


@pytest.fixture(scope="module")
def routed(_compilation_cache):
    """(router endpoint, the worker's port)."""
    cache = jax.config.jax_compilation_cache_dir
    with worker_behind_router(_flags(ENGINE), cache, "--api-key", KEY_A) as (endpoint, port, _worker):
        yield endpoint, port


def _all_free(port: int) -> None:
    deadline = time.monotonic() + 10  # deletes unpin on the worker
    while (snap := wait_idle(port)).kv.pinned and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not snap.has_unfinished and snap.kv_requests == 0 and snap.kv.used == 0 and snap.kv.pinned == 0, snap


def test_conversations_and_truncation_through_the_router(routed):
    endpoint, port = routed
    client = openai.OpenAI(base_url=endpoint.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
    conv = client.conversations.create(items=[{"role": "user", "content": "My name is Ada."}], metadata={"k": "v"})
    first = client.responses.create(input="Who am I?", conversation=conv.id, **GREEDY)
    second = client.responses.create(input="Again?", conversation=conv.id, **GREEDY)
    assert first.conversation.id == second.conversation.id == conv.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.conversations.items.list(conv.id, order="asc").data
    assert len(items) == 2 + len(first.output) + 1 + len(second.output)
    client.conversations.items.delete(items[0].id, conversation_id=conv.id)
    assert client.conversations.retrieve(conv.id).metadata == {"k": "v"}
    long = [{"role": "user", "content": f"Turn {i}: " + "story " * 30} for i in range(6)]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(input=long, store=False, **GREEDY)
    cut = client.responses.create(input=long, truncation="auto", store=False, **GREEDY)
    assert cut.usage.input_tokens + GREEDY["max_output_tokens"] <= ENGINE["max_model_len"]
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve("conv_" + "0" * 24)
    client.conversations.delete(conv.id)
    for response in (first, second):
        client.responses.delete(response.id)
    _all_free(port)


def test_a_background_stream_resumed_and_one_cancelled_through_the_router(routed):
    endpoint, port = routed
    body = {"input": "Tell me a story.", "background": True, "stream": True, "model": MODEL_NAME}
    body |= {"max_output_tokens": 120, "top_k": 1}

    async def run() -> tuple[list, list, list]:
        async with aiohttp.ClientSession(headers=HEADERS) as http:
            async with http.post(endpoint.base_url + "/v1/responses", json=body) as resp:
                first = []
                async for event in stream_events(resp):
                    first.append(event)
                    if len(first) == 5:
                        break  # the client goes away
            response_id = first[0]["response"]["id"]
            url = f"{endpoint.base_url}/v1/responses/{response_id}?stream=true&starting_after=4"
            async with http.get(url) as resp:
                rest = [event async for event in stream_events(resp)]
            async with http.post(endpoint.base_url + "/v1/responses", json={**body, "max_output_tokens": 200}) as resp:
                cancelled = []
                async for event in stream_events(resp):
                    cancelled.append(event)
                    if len(cancelled) == 4:
                        stop = f"{endpoint.base_url}/v1/responses/{cancelled[0]['response']['id']}/cancel"
                        async with http.post(stop) as answer:
                            assert (await answer.json())["status"] == "cancelled"
            for done in (first, cancelled):
                async with http.delete(f"{endpoint.base_url}/v1/responses/{done[0]['response']['id']}") as answer:
                    assert answer.status == 200
        return first, rest, cancelled

    first, rest, cancelled = asyncio.run(run())
    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert cancelled[-1]["type"] not in ("response.completed", "response.incomplete")
    _all_free(port)
