"""Admission under overload with a queue deadline (`--max-queue-wait`), on `jaxserve serve`'s stack.

At 4x the load the server can serve (measured first, in the same run): every request gets one
answer, served or 503 with Retry-After; served requests waited in the queue at most the deadline
and their latency stays bounded by it; refused ones never ran (no tokens generated for them); the
KV pool is all free afterwards. Queue depth and wait are in /metrics. Priorities: freed running
slots go to the lowest `priority` value first. (Through the router: test_router_overload.py.)
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from server_harness import KEY_A, MODEL_NAME, send, start_server, wait_until_idle

from bench.overload import Workload, measure_capacity, offer, send_one, summarize

DEADLINE = 0.5  # seconds
N = 8  # sequences per request: 8 requests fill the test engine's 64 running slots


def metric(srv, name: str, labels: str = "") -> float:
    text = send(srv, "GET", "/metrics", key=None).text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


@pytest.fixture
def deadline_server(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), max_waiting_seqs=64, max_queue_wait=DEADLINE)
    yield srv
    srv.stop()


def test_four_times_capacity_is_served_within_the_deadline_or_refused(deadline_server, async_engine):
    srv = deadline_server
    work = Workload(srv.base_url, MODEL_NAME, KEY_A, max_tokens=32, n=N)
    capacity = asyncio.run(measure_capacity(work, concurrency=64 // N, duration=3.0))
    service_time = (64 // N) / capacity  # Little's law: a request's latency at full load, no queue
    tokens_before = metric(srv, "jaxserve_generation_tokens_total")
    answers = asyncio.run(offer(work, 4 * capacity, duration=4.0))
    summary = summarize(answers)

    assert summary["lost"] == 0, summary  # every request got exactly one answer: 200 or 503
    assert summary["served"] > 0 and summary["refused_fraction"] > 0.4, summary
    for answer in answers:
        if answer.status == 503:
            assert answer.code in ("server_overloaded", "queue_timeout") and int(answer.retry_after) >= 1
        else:
            assert answer.completion_tokens == N * 32
    assert summary["refused_by_code"].get("queue_timeout", 0) > 0, summary  # the deadline did refuse some
    assert summary["served_p50_s"] <= DEADLINE + 2 * service_time, (summary, service_time)
    # Served ones waited at most the deadline (and a loop turn) for their slots.
    waits = metric(srv, "jaxserve_queue_wait_seconds_count")
    assert metric(srv, "jaxserve_queue_wait_seconds_bucket", '{le="1.0"}') == waits
    assert waits == metric(srv, "jaxserve_requests_total", '{endpoint="completions",outcome="ok"}')
    # Refused requests never ran: the tokens generated are the served ones'.
    assert metric(srv, "jaxserve_generation_tokens_total") - tokens_before == summary["served"] * N * 32
    timed_out = summary["refused_by_code"]["queue_timeout"]
    assert metric(srv, "jaxserve_requests_total", '{endpoint="completions",outcome="refused"}') == timed_out
    snap = wait_until_idle(srv, async_engine)
    assert not snap.has_unfinished and snap.kv.used == 0
    assert metric(srv, "jaxserve_queue_depth") == 0


async def _priority_order(srv) -> list[str]:
    """Fill every running slot with long streams, queue low-priority requests and then
    high-priority ones, free the slots; the order in which the queued ones finish."""
    work = Workload(srv.base_url, MODEL_NAME, KEY_A, max_tokens=16, n=N)
    finished: list[str] = []

    async def queued(http: aiohttp.ClientSession, name: str, priority: int) -> None:
        answer = await send_one(http, work, {**work.body(), "priority": priority})
        assert answer.status == 200, answer
        finished.append(name)

    async with aiohttp.ClientSession(headers=work.headers()) as http:
        fill = {**work.body(), "max_tokens": 480, "stream": True}
        streams = [await http.post(f"{srv.base_url}/v1/completions", json=fill) for _ in range(64 // N)]
        for resp in streams:
            assert resp.status == 200
            await resp.content.readline()  # running: the slots are taken
        low = [asyncio.create_task(queued(http, f"low{i}", 5)) for i in range(64 // N)]
        await _until(lambda: metric(srv, "jaxserve_queue_depth") == 64)
        high = [asyncio.create_task(queued(http, f"high{i}", -5)) for i in range(64 // N)]
        await _until(lambda: metric(srv, "jaxserve_queue_depth") == 128)
        for resp in streams:
            resp.close()  # the client leaves: the stream is aborted and its slots freed
        await asyncio.gather(*low, *high)
    return finished


async def _until(condition, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await loop.run_in_executor(None, condition):
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_freed_slots_go_to_higher_priority_requests_first(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), max_waiting_seqs=128, max_queue_wait=60)
    try:
        finished = asyncio.run(_priority_order(srv))
        # The high-priority requests arrived last but ran first: all of them before any low one.
        assert all(name.startswith("high") for name in finished[: 64 // N]), finished
        snap = wait_until_idle(srv, async_engine)
        assert not snap.has_unfinished and snap.kv.used == 0
    finally:
        srv.stop()
