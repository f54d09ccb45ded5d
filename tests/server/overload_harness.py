"""Overload checks shared by `jaxserve serve` (test_server_overload.py) and the router
(test_router_overload.py): any server with `.port` and `.base_url`, run with --max-queue-wait."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
from server_harness import KEY_A, send

from bench.overload import Workload, measure_capacity, offer, send_one, summarize


def metric(srv: Any, name: str, labels: str = "") -> float:
    text = send(srv, "GET", "/metrics", key=None).text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def check_four_times_capacity(srv: Any, model: str, slots: int, n: int, max_tokens: int, deadline: float) -> None:
    """Measure the capacity with `slots // n` clients, offer 4x it; every request gets one answer,
    served ones within the deadline, refused ones 503 + Retry-After, and never run. The server's
    waiting queue should be too long to fill in the run: then the backlog grows until requests
    wait past the deadline, however fast the machine, and the deadline is what refuses them."""
    work = Workload(srv.base_url, model, KEY_A, max_tokens=max_tokens, n=n)
    clients = slots // n
    capacity = asyncio.run(measure_capacity(work, concurrency=clients, duration=3.0))
    service_time = clients / capacity  # Little's law: a request's latency at full load, no queue
    tokens_before = metric(srv, "jaxserve_generation_tokens_total")
    answers = asyncio.run(offer(work, 4 * capacity, duration=4.0))
    summary = summarize(answers)

    assert summary["lost"] == 0, summary  # every request got exactly one answer: 200 or 503
    assert summary["served"] > 0 and summary["refused_fraction"] > 0.25, summary
    for answer in answers:
        if answer.status == 503:
            assert answer.code in ("server_overloaded", "queue_timeout") and int(answer.retry_after) >= 1
        else:
            assert answer.completion_tokens == n * max_tokens
    assert summary["refused_by_code"].get("queue_timeout", 0) > 0, summary  # the deadline did refuse some
    # (The clients share the CPU with the server here: a request's service time grows under the flood.)
    assert summary["served_p50_s"] <= deadline + 3 * service_time, (summary, service_time)
    # Served ones waited at most the deadline for their slots (`deadline` is a histogram bucket).
    waits = metric(srv, "jaxserve_queue_wait_seconds_count")
    assert metric(srv, "jaxserve_queue_wait_seconds_bucket", f'{{le="{deadline}"}}') == waits
    assert waits == metric(srv, "jaxserve_requests_total", '{endpoint="completions",outcome="ok"}')
    # Refused requests never ran: the tokens generated are the served ones'.
    assert metric(srv, "jaxserve_generation_tokens_total") - tokens_before == summary["served"] * n * max_tokens
    timed_out = summary["refused_by_code"]["queue_timeout"]
    assert metric(srv, "jaxserve_requests_total", '{endpoint="completions",outcome="refused"}') == timed_out


async def priority_order(srv: Any, model: str, slots: int, n: int, fill_tokens: int) -> list[str]:
    """Fill every running slot with long streams, queue low-priority requests and then as many
    high-priority ones, free the slots; the order in which the queued ones finish."""
    work = Workload(srv.base_url, model, KEY_A, max_tokens=16, n=n)
    finished: list[str] = []
    each = slots // n

    async def queued(http: aiohttp.ClientSession, name: str, priority: int) -> None:
        answer = await send_one(http, work, {**work.body(), "priority": priority})
        assert answer.status == 200, answer
        finished.append(name)

    async with aiohttp.ClientSession(headers=work.headers()) as http:
        fill = {**work.body(), "max_tokens": fill_tokens, "stream": True}
        streams = [await http.post(f"{srv.base_url}/v1/completions", json=fill) for _ in range(each)]
        for resp in streams:
            assert resp.status == 200, await resp.text()
            await resp.content.readline()  # running: the slots are taken
        low = [asyncio.create_task(queued(http, f"low{i}", 5)) for i in range(each)]
        await until(lambda: metric(srv, "jaxserve_queue_depth") == slots)
        high = [asyncio.create_task(queued(http, f"high{i}", -5)) for i in range(each)]
        await until(lambda: metric(srv, "jaxserve_queue_depth") == 2 * slots)
        for resp in streams:
            resp.close()  # the client leaves: the stream is aborted and its slots freed
        await asyncio.gather(*low, *high)
    return finished


async def until(condition: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await loop.run_in_executor(None, condition):
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)
