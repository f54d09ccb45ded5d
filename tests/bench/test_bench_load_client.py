"""The load generator and its SSE client against a scripted aiohttp server (no model, a second or two)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from bench.http_client import Endpoint
from bench.load import LoadSpec, run_load
from bench.workloads import BenchRequest, Conversation, Workload

FIRST_DELAY_S = 0.05
GAP_S = 0.02
PIECES = ["a", "b", "c", "d"]


class ScriptedServer:
    """Streams PIECES after FIRST_DELAY_S, GAP_S apart, then a usage chunk; counts requests in flight."""

    def __init__(self, separator: str = "\n\n") -> None:
        self.separator = separator  # what ends an SSE event
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body.get("max_tokens", 0) > 100:
            return web.json_response({"error": {"message": "max_tokens too large"}}, status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await asyncio.sleep(FIRST_DELAY_S)
            chat = "messages" in body
            for i, piece in enumerate(PIECES):
                if i:
                    await asyncio.sleep(GAP_S)
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                await response.write(f"data: {json.dumps({'choices': [choice]})}{self.separator}".encode())
            usage = {"prompt_tokens": 7, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}
            end = f"data: {json.dumps({'choices': [], 'usage': usage})}{self.separator}data: [DONE]{self.separator}"
            await response.write(end.encode())
            return response
        finally:
            self.in_flight -= 1


@pytest.fixture
def scripted() -> ScriptedServer:
    return ScriptedServer()


async def _serve(server: ScriptedServer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _run(server: ScriptedServer, workload: Workload, spec: LoadSpec):
    async def go():
        runner, url = await _serve(server)
        try:
            endpoint = Endpoint(url, "m", {"ignore_eos": True})
            return await run_load(endpoint, workload, spec, tokenizer=None, show_progress=False)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_timings_tokens_and_body(scripted):
    workload = Workload("t", [BenchRequest([1, 2, 3], 5, 3)], {})
    (record,), duration = _run(scripted, workload, LoadSpec())
    assert record.success, record.error
    assert record.ttft >= FIRST_DELAY_S
    assert len(record.itl) == 3 and all(g >= GAP_S * 0.9 for g in record.itl)
    assert record.output_tokens == 5 and record.prompt_tokens == 7 and record.cached_tokens == 3
    assert record.tpot == pytest.approx((record.e2el - record.ttft) / 4)
    assert record.output_text == "abcd"
    assert duration >= record.e2el
    body = scripted.bodies[0]
    assert body["prompt"] == [1, 2, 3] and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0


def test_crlf_event_separators():
    workload = Workload("t", [BenchRequest("hi", 5, 1)], {})
    (record,), _ = _run(ScriptedServer("\r\n\r\n"), workload, LoadSpec())
    assert record.success and record.output_text == "abcd" and record.output_tokens == 5


def test_errors_are_recorded_not_raised(scripted):
    workload = Workload("t", [BenchRequest("hi", 500, 1), BenchRequest("hi", 5, 1)], {})
    records, _ = _run(scripted, workload, LoadSpec())
    failed = [r for r in records if not r.success]
    assert len(failed) == 1 and "HTTP 400" in failed[0].error


def test_closed_loop_never_exceeds_max_concurrency(scripted):
    workload = Workload("t", [BenchRequest([1], 5, 1) for _ in range(12)], {})
    records, duration = _run(scripted, workload, LoadSpec(max_concurrency=3))
    assert all(r.success for r in records)
    assert scripted.max_in_flight == 3
    one = FIRST_DELAY_S + 3 * GAP_S
    assert duration >= 4 * one * 0.9  # 12 requests, 3 at a time: at least 4 rounds


def test_poisson_pacing_spreads_the_starts(scripted):
    workload = Workload("t", [BenchRequest([1], 5, 1) for _ in range(6)], {})
    records, _ = _run(scripted, workload, LoadSpec(request_rate=20.0, seed=3))
    starts = sorted(r.start for r in records)
    assert starts[-1] - starts[0] > 0.05  # not all at once


def test_conversation_resends_the_history(scripted):
    workload = Workload("t", [Conversation(["hello", "again"], 5, system="be brief")], {})
    records, _ = _run(scripted, workload, LoadSpec(multi_turn_api="history"))
    assert [r.group for r in records] == ["turn-1", "turn-2+"]
    second = scripted.bodies[1]["messages"]
    assert second == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "abcd"}, {"role": "user", "content": "again"}]  # fmt: skip
