"""Streaming a background response (`background: true, stream: true`) on the tiny random model: the
events through the official openai client and streamed again from a sequence number; a raw aiohttp
client that goes away mid-stream while the response goes on, then resumes it; a cancel that ends
the streams; bad resumes. The KV pool is all free after each test."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest
from server_harness import (
    KEY_A,
    MODEL_NAME,
    send,
    stream_events,
)

LONG = dict(model=MODEL_NAME, max_output_tokens=120, extra_body={"top_k": 1})
HEADERS = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}

pytestmark = pytest.mark.usefixtures("stored_responses_cleared")


def _text(events) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def _finished(client, response_id: str):
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return got


def test_a_background_stream_and_its_resumption_through_the_openai_client(client):
    events = [
        e.model_dump() for e in client.responses.create(input="Tell me a story.", background=True, stream=True, **LONG)
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[0]["response"]["background"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    response_id = events[0]["response"]["id"]
    stored = client.responses.retrieve(response_id)
    assert stored.model_dump() == events[-1]["response"] and _text(events) == stored.output_text
    again = [e.model_dump() for e in client.responses.retrieve(response_id, stream=True, starting_after=5)]
    assert again == events[6:]
    whole = [e.model_dump() for e in client.responses.retrieve(response_id, stream=True)]
    assert whole == events
    not_background = client.responses.create(input="Hi", model=MODEL_NAME, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError):
        list(client.responses.retrieve(not_background.id, stream=True))


def test_a_client_that_goes_away_mid_stream_resumes_where_it_was(server, client):
    async def run() -> tuple[str, list, list]:
        body = {"input": "Tell me a story.", "background": True, "stream": True, **LONG, **LONG["extra_body"]}
        del body["extra_body"]
        async with aiohttp.ClientSession(headers=HEADERS) as http:
            async with http.post(server.base_url + "/v1/responses", json=body) as resp:
                assert resp.status == 200
                first = []
                async for event in stream_events(resp):
                    first.append(event)
                    if len(first) == 6:
                        break  # leaving the block closes the connection mid-stream
            response_id = first[0]["response"]["id"]
            await asyncio.sleep(0.2)
            url = f"{server.base_url}/v1/responses/{response_id}?stream=true&starting_after=5"
            async with http.get(url) as resp:
                assert resp.status == 200
                rest = [event async for event in stream_events(resp)]
        return response_id, first, rest

    response_id, first, rest = asyncio.run(run())
    events = first + rest
    assert len(rest) > len(first)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    done = _finished(client, response_id)
    assert _text(events) == done.output_text and done.usage.output_tokens > 6
    plain = client.responses.create(input="Tell me a story.", store=False, **LONG)
    assert done.output_text == plain.output_text  # the response went on while no one listened


def test_cancel_ends_the_streams_of_a_background_response(server, client):
    async def run() -> tuple[str, list]:
        body = {"input": "Write a long essay.", "background": True, "stream": True, "model": MODEL_NAME}
        body |= {"max_output_tokens": 400, "top_k": 1}
        async with aiohttp.ClientSession(headers=HEADERS) as http:
            async with http.post(server.base_url + "/v1/responses", json=body) as resp:
                events = []
                async for event in stream_events(resp):
                    events.append(event)
                    if len(events) == 4:
                        url = f"{server.base_url}/v1/responses/{events[0]['response']['id']}/cancel"
                        async with http.post(url) as cancelled:
                            assert cancelled.status == 200 and (await cancelled.json())["status"] == "cancelled"
        return events[0]["response"]["id"], events

    response_id, events = asyncio.run(run())  # the stream ended: the loop above finished
    assert events[-1]["type"] not in ("response.completed", "response.incomplete")
    assert client.responses.retrieve(response_id).status == "cancelled"


@pytest.mark.parametrize("query", ["stream=true&starting_after=x", "stream=true&starting_after=-5", "stream=maybe"])
def test_bad_resumes_are_400s(client, server, query):
    started = client.responses.create(input="Hi", background=True, model=MODEL_NAME, max_output_tokens=4)
    _finished(client, started.id)
    reply = send(server, "GET", f"/v1/responses/{started.id}?{query}")
    assert reply.status == 400, reply.text
    assert reply.json["error"]["param"] in ("starting_after", "stream")
