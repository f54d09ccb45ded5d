"""The server's queue with a deadline (server/run_slots.py): who gets freed running slots, when a
waiting request is refused, and that leaving the queue (refused, cancelled, withdrawn) gives
back nothing it did not hold."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.errors import APIError
from server.run_slots import RunSlots


def test_freed_slots_go_to_the_lowest_priority_value_then_the_earliest():
    async def run() -> list[str]:
        slots = RunSlots(2, max_wait=10)
        running = [slots.take(1, 0), slots.take(1, 0)]
        order: list[str] = []

        async def queued(name: str, priority: int) -> None:
            ticket = slots.take(1, priority)
            await slots.wait(ticket)
            order.append(name)

        tasks = [asyncio.create_task(queued(name, p)) for name, p in [("late", 5), ("b", -1), ("a", -1), ("d", 0)]]
        await asyncio.sleep(0)
        assert slots.waiting_requests == 4 and slots.used == 2
        for ticket in running:
            slots.release(ticket)
        await asyncio.sleep(0.05)  # the granted waiters wake
        assert order == ["b", "a"] and slots.used == 2  # only two slots: "d" and "late" still wait
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return order

    asyncio.run(run())


def test_a_request_waiting_past_the_deadline_is_refused_with_retry_after_and_holds_nothing():
    async def run() -> None:
        slots = RunSlots(1, max_wait=0.05)
        holder = slots.take(1, 0)
        waiter = slots.take(1, 0)
        with pytest.raises(APIError) as refused:
            await slots.wait(waiter)
        assert refused.value.status == 503 and refused.value.code == "queue_timeout"
        assert refused.value.headers["Retry-After"] == "1"
        assert slots.waiting_requests == 0 and slots.used == 1
        slots.release(waiter)  # a refused ticket gives back nothing
        assert slots.used == 1
        slots.release(holder)
        assert slots.used == 0

    asyncio.run(run())


def test_slots_freed_after_a_deadline_passed_are_not_granted_even_when_its_timer_is_late():
    async def run() -> None:
        slots = RunSlots(1, max_wait=0.05)
        holder = slots.take(1, 0)
        late = slots.take(1, 0)
        time.sleep(0.1)  # the loop is busy: the waiter's timer cannot fire
        slots.release(holder)
        assert not late.holding and slots.used == 0
        with pytest.raises(APIError) as refused:
            await slots.wait(late)
        assert refused.value.code == "queue_timeout"
        on_time = slots.take(1, 0)
        await slots.wait(on_time)
        assert on_time.holding and on_time.waited < 0.01

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_runs():
    async def run() -> None:
        slots = RunSlots(2, max_wait=10)
        holder = slots.take(2, 0)
        big = slots.take(2, 0)
        small = slots.take(1, 0)
        waiting = asyncio.create_task(slots.wait(big))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert slots.waiting_requests == 1
        slots.release(holder)
        await slots.wait(small)
        assert slots.used == 1 and small.holding and not big.holding

    asyncio.run(run())


def test_a_large_request_is_not_overtaken_and_claims_at_most_every_slot():
    async def run() -> None:
        slots = RunSlots(4, max_wait=10)
        first = slots.take(3, 0)
        huge = slots.take(9, 0)  # more sequences than slots: it claims all four
        small = slots.take(1, 0)  # one slot is free, but the huge request is ahead
        assert huge.seqs == 4 and not huge.holding and not small.holding
        slots.release(first)
        assert huge.holding and not small.holding and slots.used == 4
        slots.release(huge)
        assert small.holding and slots.used == 1

    asyncio.run(run())


def test_withdrawn_waiters_end_with_the_error_or_without_slots():
    async def run() -> None:
        slots = RunSlots(1, max_wait=10)
        slots.take(1, 0)
        stopping, cancelled = slots.take(1, 0), slots.take(1, 0)
        slots.withdraw(stopping, APIError(503, "stopping", code="server_shutting_down"))
        with pytest.raises(APIError, match="stopping"):
            await slots.wait(stopping)
        slots.withdraw(cancelled, None)
        await slots.wait(cancelled)
        assert not cancelled.holding and slots.used == 1 and slots.waiting_requests == 0

    asyncio.run(run())


def test_slots_follow_the_engines_capacity_now_and_waiters_get_the_slots_of_a_worker_that_comes_back():
    async def run() -> None:
        capacity = [1]  # a router with one of its two one-slot workers down
        slots = RunSlots(2, max_wait=10, capacity=lambda: capacity[0])
        first, second = slots.take(1, 0), slots.take(1, 0)
        assert first.granted.done() and not second.granted.done() and slots.used == 1
        waiting = asyncio.create_task(slots.wait(second))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # nothing was released: only the capacity can let it through
        capacity[0] = 2  # the worker is back: granted at the next look, with no release
        await asyncio.wait_for(waiting, 2)
        assert slots.used == 2 and slots.waiting_requests == 0
        slots.release(first)
        slots.release(second)
        assert slots.used == 0

    asyncio.run(run())
