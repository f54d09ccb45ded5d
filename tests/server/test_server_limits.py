"""Rate limits (429 + Retry-After), the bounded queue (503) and the per-request timeout (504)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from server_harness import KEY_A, KEY_B, MODEL_NAME, send, sse_events, start_server, wait_until_idle

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
LONG = {**CHAT, "max_tokens": 300, "ignore_eos": True}


@pytest.fixture
def limited(async_engine, request):
    srv = start_server(async_engine, api_keys=(KEY_A, KEY_B), **request.param)
    yield srv
    srv.stop()


@pytest.mark.parametrize("limited", [{"rate_limit_rpm": 3}], indirect=True)
def test_requests_per_minute_per_key(limited):
    assert [send(limited, "POST", "/v1/chat/completions", CHAT).status for _ in range(3)] == [200] * 3
    refused = send(limited, "POST", "/v1/chat/completions", CHAT)
    assert refused.status == 429
    assert refused.json["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert send(limited, "POST", "/v1/chat/completions", CHAT, key=KEY_B).status == 200  # per key


@pytest.mark.parametrize("limited", [{"rate_limit_tpm": 20}], indirect=True)
def test_generated_tokens_per_minute_per_key(limited):
    first = send(
        limited,
        "POST",
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 25, "ignore_eos": True},
    )
    assert first.status == 200 and first.json["usage"]["completion_tokens"] == 25
    refused = send(limited, "POST", "/v1/chat/completions", CHAT)
    assert refused.status == 429 and refused.json["error"]["code"] == "rate_limit_exceeded_tokens"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert send(limited, "POST", "/v1/chat/completions", CHAT, key=KEY_B).status == 200


async def _fill_queue_then_ask(base: str) -> tuple[int, str, int]:
    """Hold 64 sequences in flight (8 streams of n=8), then send one more request."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with aiohttp.ClientSession(base, headers=headers) as http:
        streams = [await http.post("/v1/chat/completions", json={**LONG, "n": 8, "stream": True}) for _ in range(8)]
        try:
            for resp in streams:
                assert resp.status == 200
                await resp.content.readline()  # the stream has started: its sequences are counted
            async with http.post("/v1/chat/completions", json=CHAT) as extra:
                status, retry = extra.status, extra.headers.get("Retry-After", "")
            return status, retry, len(streams)
        finally:
            for resp in streams:
                resp.close()  # disconnect: the server aborts them


@pytest.mark.parametrize("limited", [{"max_waiting_seqs": 0}], indirect=True)
def test_full_waiting_queue_is_503(limited, async_engine):
    status, retry, _ = asyncio.run(_fill_queue_then_ask(limited.base_url))
    assert status == 503 and retry == "1"
    snap = wait_until_idle(limited, async_engine)
    assert not snap.has_unfinished and snap.kv.used == 0
    assert send(limited, "POST", "/v1/chat/completions", CHAT).status == 200  # room again


@pytest.mark.parametrize("limited", [{"request_timeout": 0.2}], indirect=True)
def test_request_timeout_aborts_the_request(limited, async_engine):
    # 480 decode steps of 8 sequences: far over 0.2 s of host work alone (~1 ms a step at best),
    # even for the tiny model. (1.5 s was not: on a quiet machine all 480 steps fit in it.)
    slow = {**LONG, "max_tokens": 480, "n": 8}
    reply = send(limited, "POST", "/v1/chat/completions", slow)
    assert reply.status == 504 and reply.json["error"]["code"] == "request_timeout"
    streamed = send(limited, "POST", "/v1/chat/completions", {**slow, "stream": True})
    assert streamed.status == 200
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout"
    snap = wait_until_idle(limited, async_engine)
    assert not snap.has_unfinished and snap.kv.used == 0


@pytest.mark.parametrize("limited", [{"max_sessions_per_key": 2}], indirect=True)
def test_sessions_per_key_are_capped(limited):
    assert [send(limited, "POST", "/v1/sessions", {}).status for _ in range(2)] == [200, 200]
    refused = send(limited, "POST", "/v1/sessions", {})
    assert refused.status == 429 and refused.json["error"]["code"] == "session_limit_reached"
    assert send(limited, "POST", "/v1/sessions", {}, key=KEY_B).status == 200  # per key
    first = send(limited, "GET", "/v1/sessions").json["data"][0]["id"]
    assert send(limited, "POST", f"/v1/sessions/{first}/fork", {"at": 0}).status == 429  # forks count too
    assert send(limited, "DELETE", f"/v1/sessions/{first}").status == 200
    assert send(limited, "POST", "/v1/sessions", {}).status == 200


@pytest.mark.parametrize("limited", [{"max_waiting_seqs": 0}], indirect=True)
def test_a_request_that_can_never_fit_is_400_not_503(limited):
    """64 prompts x n=2 is twice what this server holds at once: no retry would ever pass."""
    body = {"model": MODEL_NAME, "prompt": ["Hello"] * 64, "n": 2, "max_tokens": 2}
    refused = send(limited, "POST", "/v1/completions", body)
    assert refused.status == 400 and "retry-after" not in refused.headers
    assert refused.json["error"]["code"] == "request_too_large" and "at most 64" in refused.json["error"]["message"]
    assert send(limited, "POST", "/v1/completions", {**body, "n": 1}).status == 200  # the same load that fits
