"""50 concurrent streaming clients, a third of them hanging up at random points.

Every other stream must complete; afterwards no request is left in the engine, no KV block is
held by a request, the block accounting is intact, aborted requests did not run on, serving
compiled nothing new, and `/metrics` reports the traffic.
"""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import aclosing

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from server_harness import KEY_A, MODEL_NAME, check_kv_integrity, send, snapshot, stream_events, wait_until_idle

from jaxserve.sampling_params import SamplingParams
from server.generation import EngineRequest, Generation
from server.metrics import ServerMetrics
from server.rate_limit import RateLimiter

NUM_CLIENTS = 50
MAX_TOKENS = 24
HANGUP_MAX_TOKENS = 400  # a hung-up request that kept running would take hundreds of steps


async def _client(http: aiohttp.ClientSession, i: int, hang_up_after: int | None) -> dict:
    body = {
        "model": MODEL_NAME,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 1.0,
        "seed": i,
        "messages": [{"role": "user", "content": f"Client {i}: the quick brown fox " * (1 + i % 3)}],
        "max_tokens": HANGUP_MAX_TOKENS if hang_up_after is not None else MAX_TOKENS,
        "ignore_eos": True,
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    text, events = "", []
    try:
        async for event in stream_events(resp):
            events.append(event)
            if isinstance(events[-1], dict) and events[-1]["choices"]:
                text += events[-1]["choices"][0]["delta"].get("content") or ""
            if hang_up_after is not None and len(events) >= hang_up_after:
                resp.close()  # drop the connection mid-stream
                return {"hung_up": True}
    finally:
        resp.release()
    return {"hung_up": False, "events": events, "text": text}


async def _run_clients(base: str) -> list[dict]:
    rng = random.Random(0)
    plan = [rng.randint(1, 12) if i % 3 == 0 else None for i in range(NUM_CLIENTS)]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base, headers={"Authorization": f"Bearer {KEY_A}"}, connector=connector) as http:
        return await asyncio.gather(*(_client(http, i, plan[i]) for i in range(NUM_CLIENTS)))


def _samples(srv) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(send(srv, "GET", "/metrics", key=None).text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_fifty_streams_with_a_third_hanging_up(server, warm_engine):
    async_engine = warm_engine.async_engine
    generated_before = snapshot(server, async_engine).generated_tokens
    metrics_before = _samples(server)
    results = asyncio.run(_run_clients(server.base_url))

    completed = [r for r in results if not r["hung_up"]]
    assert len(completed) == NUM_CLIENTS - len(range(0, NUM_CLIENTS, 3))
    for r in completed:
        events = r["events"]
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS
        finals = [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"]]
        assert finals[-1] == "length" and all(f is None for f in finals[:-1])

    snap = wait_until_idle(server, async_engine, timeout=10)
    assert not snap.has_unfinished and snap.running == snap.waiting == snap.swapped == 0
    assert snap.kv_requests == 0 and snap.kv.used == 0
    assert snap.kv.free + snap.kv.cached_idle + snap.kv.pinned == snap.kv.num_blocks
    check_kv_integrity(server, async_engine)
    # Hung-up requests were aborted, not run to their 480 tokens.
    generated = snapshot(server, async_engine).generated_tokens - generated_before
    hung_up = NUM_CLIENTS - len(completed)
    assert generated < len(completed) * MAX_TOKENS + hung_up * 60
    assert snapshot(server, async_engine).num_compilations == warm_engine.compilations_after_warm_up

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - metrics_before.get(key, 0.0)

    # A hung-up request's handler counts its outcome after the engine has aborted it (once its
    # stream tasks are done), so the engine can be idle a moment before the last one is counted.
    deadline = time.monotonic() + 10
    while True:
        after = _samples(server)
        outcomes = sum(delta("jaxserve_requests_total", endpoint="chat", outcome=o) for o in ("ok", "cancelled"))
        if outcomes >= NUM_CLIENTS or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    assert delta("jaxserve_requests_total", endpoint="chat", outcome="ok") == len(completed)
    assert delta("jaxserve_requests_total", endpoint="chat", outcome="cancelled") == hung_up
    assert delta("jaxserve_time_to_first_token_seconds_count") == NUM_CLIENTS
    assert delta("jaxserve_e2e_request_latency_seconds_count") == NUM_CLIENTS
    assert delta("jaxserve_time_per_output_token_seconds_count") >= len(completed)
    assert delta("jaxserve_generation_tokens_total") >= len(completed) * MAX_TOKENS
    assert delta("jaxserve_prompt_tokens_total") > 0
    assert delta("jaxserve_engine_step_seconds_count") > 0
    assert after[("jaxserve_num_requests", (("state", "running"),))] == 0
    assert after[("jaxserve_kv_blocks", (("state", "used"),))] == 0
    assert after[("jaxserve_kv_blocks_total", ())] == snap.kv.num_blocks
    assert after[("jaxserve_compilations_total", ())] == warm_engine.compilations_after_warm_up
    assert after[("jaxserve_engine_alive", ())] == 1


def test_a_hang_up_is_counted_when_the_handler_is_cancelled_again_during_its_clean_up(server, async_engine):
    """A failed write ends the stream; aiohttp then cancels the handler as the connection drops,
    which lands while the generation waits for its stream tasks. It must still count its outcome."""
    metrics = ServerMetrics()
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    generation = Generation(
        async_engine,
        [EngineRequest("hang-up-twice", [1, 2, 3], params)],
        owner="a",
        endpoint="chat",
        metrics=metrics,
        limiter=RateLimiter(),
        timeout=None,
    )

    async def handler():
        async with aclosing(generation.deltas()) as deltas:
            async for _ in deltas:
                asyncio.get_running_loop().call_soon(handler_task.cancel)  # runs once the clean-up waits
                raise ConnectionResetError("Cannot write to closing transport")

    async def main():
        nonlocal handler_task
        handler_task = asyncio.create_task(handler())
        try:
            await handler_task
        except (asyncio.CancelledError, ConnectionResetError):
            pass
        return handler_task.cancelled()

    handler_task = None
    assert asyncio.run(main())  # the second cancellation reached the clean-up
    assert generation.done and generation.outcome == "cancelled"
    assert (
        metrics.registry.get_sample_value("jaxserve_requests_total", {"endpoint": "chat", "outcome": "cancelled"}) == 1
    )
    # Deltas that reach the closed loop afterwards abort the request; the engine serves on.
    assert not wait_until_idle(server, async_engine, timeout=10).has_unfinished
    assert async_engine.is_alive
