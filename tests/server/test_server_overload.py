"""Admission under overload with a queue deadline (`--max-queue-wait`), on `jaxserve serve`'s stack.

At 4x the load the server can serve (measured first, in the same run): every request gets one
answer, served or 503 with Retry-After; served requests waited in the queue at most the deadline
and their latency stays bounded by it; refused ones never ran (no tokens generated for them); the
KV pool is all free afterwards. Queue depth and wait are in /metrics. Priorities: freed running
slots go to the lowest `priority` value first. (Through the router: test_router_overload.py.)
"""

from __future__ import annotations

import asyncio

import aiohttp
from overload_harness import check_four_times_capacity, metric, priority_order, until
from server_harness import KEY_A, MODEL_NAME, start_server, wait_until_idle

from bench.overload import Workload, send_one

SLOTS = 64  # the test engine's max_num_seqs
N = 8  # sequences per request: 8 requests fill the running slots


def test_four_times_capacity_is_served_within_the_deadline_or_refused(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), max_waiting_seqs=4096, max_queue_wait=0.5)
    try:
        check_four_times_capacity(srv, MODEL_NAME, SLOTS, N, max_tokens=128, deadline=0.5)
        snap = wait_until_idle(srv, async_engine)
        assert not snap.has_unfinished and snap.kv.used == 0
        assert metric(srv, "jaxserve_queue_depth") == 0
    finally:
        srv.stop()


def test_freed_slots_go_to_higher_priority_requests_first(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), max_waiting_seqs=2 * SLOTS, max_queue_wait=60)
    try:
        finished = asyncio.run(priority_order(srv, MODEL_NAME, SLOTS, N, fill_tokens=480))
        # The high-priority requests arrived last but ran first: all of them before any low one.
        assert all(name.startswith("high") for name in finished[: SLOTS // N]), finished
        snap = wait_until_idle(srv, async_engine)
        assert not snap.has_unfinished and snap.kv.used == 0
    finally:
        srv.stop()


def test_a_queued_request_gets_503_when_the_server_stops(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), max_queue_wait=60, shutdown_timeout=0.2)
    work = Workload(srv.base_url, MODEL_NAME, KEY_A, max_tokens=480, n=N)

    async def run():
        async with aiohttp.ClientSession(headers=work.headers()) as http:
            fill = {**work.body(), "stream": True}
            fills = [await http.post(f"{srv.base_url}/v1/completions", json=fill) for _ in range(SLOTS // N)]
            for resp in fills:
                await resp.content.readline()  # running: every slot is taken
            queued = asyncio.create_task(send_one(http, work))
            await until(lambda: metric(srv, "jaxserve_queue_depth") == N)
            await asyncio.get_running_loop().run_in_executor(None, srv.stop)
            for resp in fills:
                resp.close()
            return await queued

    answer = asyncio.run(run())
    assert answer.status == 503 and answer.code == "server_shutting_down", answer
    checker = start_server(async_engine)  # (the stopped server's loop is gone)
    try:
        snap = wait_until_idle(checker, async_engine)
        assert not snap.has_unfinished and snap.kv.used == 0
    finally:
        checker.stop()
