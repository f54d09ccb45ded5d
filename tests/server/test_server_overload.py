"""Admission under overload with a queue deadline (`--max-queue-wait`), on `jaxserve serve`'s stack.

At 4x the load the server can serve (measured first, in the same run): every request gets one
answer, served or 503 with Retry-After; served requests waited in the queue at most the deadline
and their latency stays bounded by it; refused ones never ran (no tokens generated for them); the
KV pool is all free afterwards. Queue depth and wait are in /metrics. Priorities: freed running
slots go to the lowest `priority` value first. (Through the router: test_router_overload.py.)
"""

from __future__ import annotations

import asyncio

from overload_harness import check_four_times_capacity, metric, priority_order
from server_harness import KEY_A, MODEL_NAME, start_server, wait_until_idle

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
