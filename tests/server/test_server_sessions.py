"""Session flows end to end: turns, fork, edit, cancel + continue, delete, expiry, persistence.

Prefix-cache reuse is proven from the usage the server reports (`cached_tokens`: prompt tokens
the engine did not recompute) and from the `/metrics` hit counter.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from server_harness import BLOCK_SIZE, KEY_A, send, start_server, stream_events

from server.auth import owner_id

SYSTEM = "You are a helpful assistant. The answer is in the question. " * 3
GREEDY = {"temperature": 0, "max_tokens": 8}


def ok(reply):
    assert reply.status == 200, reply.text
    return reply.json


def create(srv, **body):
    return ok(send(srv, "POST", "/v1/sessions", {"system": SYSTEM, **GREEDY, **body}))


def turn(srv, sid, content, **body):
    return ok(send(srv, "POST", f"/v1/sessions/{sid}/messages", {"role": "user", "content": content, **body}))


def get(srv, sid):
    return ok(send(srv, "GET", f"/v1/sessions/{sid}"))


def cached(reply) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def history_len(reply) -> int:
    return reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]


def reused_blocks_of(history: int) -> int:
    """Tokens of a history the cache must hold: full blocks of all but the last token (the last
    sampled token's KV is never computed)."""
    return (history - 1) // BLOCK_SIZE * BLOCK_SIZE


def metric(srv, name: str) -> float:
    text = send(srv, "GET", "/metrics", key=None).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def pinned_blocks(srv, async_engine, key: str) -> int:
    return srv.engine_call(async_engine, lambda dp: sum(e.kv.leases.pinned_by(owner_id(key)) for e in dp.replicas))


def test_three_turns_compute_only_the_new_tokens(server, async_engine):
    session = create(server)
    hits_before = metric(server, "jaxserve_prefix_cache_hit_tokens_total")
    replies = [turn(server, session["id"], q) for q in ("Hello world!", "How are you today?", "The quick brown fox.")]
    messages = get(server, session["id"])["messages"]
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3
    assert [m["content"] for m in messages[2::2]] == [r["choices"][0]["message"]["content"] for r in replies]
    for previous, current in zip(replies, replies[1:]):
        history = history_len(previous)
        assert cached(current) >= reused_blocks_of(history)
        new_tokens = current["usage"]["prompt_tokens"] - history
        assert current["usage"]["prompt_tokens"] - cached(current) <= new_tokens + BLOCK_SIZE
    hits = metric(server, "jaxserve_prefix_cache_hit_tokens_total") - hits_before
    assert hits >= cached(replies[1]) + cached(replies[2])
    deadline = time.monotonic() + 10
    while pinned_blocks(server, async_engine, KEY_A) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pinned_blocks(server, async_engine, KEY_A) >= reused_blocks_of(history_len(replies[2])) // BLOCK_SIZE


def test_fork_at_turn_two_shares_the_history_and_diverges(server):
    session = create(server)
    turn(server, session["id"], "Hello world!")
    second = turn(server, session["id"], "How are you today?")
    fork = ok(send(server, "POST", f"/v1/sessions/{session['id']}/fork", {"at": 5}))
    assert fork["id"] != session["id"]
    assert fork["messages"] == get(server, session["id"])["messages"][:5]
    original = turn(server, session["id"], "Streaming text arrives token by token.")
    forked = turn(server, fork["id"], "def add(a, b): return a + b")
    assert cached(forked) >= reused_blocks_of(history_len(second))  # the fork reuses the shared KV
    assert cached(original) >= reused_blocks_of(history_len(second))
    a, b = get(server, session["id"])["messages"], get(server, fork["id"])["messages"]
    assert len(a) == len(b) == 7 and a[:5] == b[:5]
    assert a[5]["content"] != b[5]["content"]
    early = ok(send(server, "POST", f"/v1/sessions/{session['id']}/fork", {"at": 2}))
    assert early["messages"] == a[:2]


def test_edit_turn_one_truncates_and_regenerates(server):
    session = create(server)
    turn(server, session["id"], "Hello world!")
    turn(server, session["id"], "How are you today?")
    edited = ok(send(server, "PUT", f"/v1/sessions/{session['id']}/messages/1", {"content": "The lazy dog."}))
    messages = get(server, session["id"])["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[1]["content"] == "The lazy dog."
    assert messages[2]["content"] == edited["choices"][0]["message"]["content"]
    assert cached(edited) >= 2 * BLOCK_SIZE  # the system prompt before message 1 was reused
    fixed = ok(
        send(
            server,
            "PUT",
            f"/v1/sessions/{session['id']}/messages/2",
            {"role": "assistant", "content": "A better answer."},
        )
    )
    assert fixed["messages"][2] == {"role": "assistant", "content": "A better answer."}
    assert len(fixed["messages"]) == 3


async def _stream_then_cancel(base: str, sid: str) -> tuple[str, list, dict, int, dict]:
    """Stream a long reply, try a second reply (409), cancel, read the stream to its end."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with aiohttp.ClientSession(base, headers=headers) as http:
        body = {
            "content": "Tell me everything.",
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 200,
            "ignore_eos": True,
        }
        async with http.post(f"/v1/sessions/{sid}/messages", json=body) as resp:
            assert resp.status == 200
            text, events, cancelled = "", [], None
            busy_status = 0
            async for event in stream_events(resp):
                events.append(event)
                if isinstance(event, dict) and event["choices"]:
                    text += event["choices"][0]["delta"].get("content", "")
                if cancelled is None and sum(1 for e in events if isinstance(e, dict) and e["choices"]) >= 4:
                    async with http.post(f"/v1/sessions/{sid}/messages", json={"content": "again"}) as second:
                        busy_status = second.status
                    async with http.post(f"/v1/sessions/{sid}/cancel") as c:
                        assert c.status == 200
                        cancelled = await c.json()
    return text, events, cancelled, busy_status, events[-2]["usage"]


def test_cancel_mid_stream_keeps_the_partial_reply_then_continue(server):
    session = create(server, skip_special_tokens=False)  # message text == the raw tokens' text
    turn(server, session["id"], "Hello world!")
    text, events, cancelled, busy_status, usage = asyncio.run(_stream_then_cancel(server.base_url, session["id"]))
    assert busy_status == 409
    assert events[-1] == "[DONE]"
    finals = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e["choices"]]
    assert finals[-1] == "abort"
    assert 0 < usage["completion_tokens"] < 200
    assert cancelled["messages"][-1] == {"role": "assistant", "content": text}
    assert not cancelled["replying"]
    more = ok(send(server, "POST", f"/v1/sessions/{session['id']}/continue", {"max_tokens": 6}))
    last = get(server, session["id"])["messages"][-1]
    assert last["role"] == "assistant"
    assert last["content"] == text + more["choices"][0]["message"]["content"]
    assert cached(more) >= reused_blocks_of(usage["prompt_tokens"] + usage["completion_tokens"])
    assert send(server, "POST", f"/v1/sessions/{session['id']}/cancel").status == 409  # nothing in flight


def test_delete_lists_and_releases_pins(server, async_engine):
    session = create(server)
    turn(server, session["id"], "Hello world!")
    listed = ok(send(server, "GET", "/v1/sessions"))
    assert session["id"] in [s["id"] for s in listed["data"]]
    for s in listed["data"]:
        deleted = ok(send(server, "DELETE", f"/v1/sessions/{s['id']}"))
        assert deleted == {"id": s["id"], "object": "session.deleted", "deleted": True}
    assert send(server, "GET", f"/v1/sessions/{session['id']}").status == 404
    assert send(server, "DELETE", f"/v1/sessions/{session['id']}").status == 404
    assert ok(send(server, "GET", "/v1/sessions"))["data"] == []
    deadline = time.monotonic() + 120  # unpinning is queued behind the engine's steps; a loaded machine is slow
    while pinned_blocks(server, async_engine, KEY_A) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pinned_blocks(server, async_engine, KEY_A) == 0


def test_sessions_survive_a_restart(async_engine, tmp_path):
    first = start_server(async_engine, api_keys=(KEY_A,), session_dir=tmp_path)
    try:
        session = create(first)
        first_turn = turn(first, session["id"], "Hello world!")
        before = get(first, session["id"])
    finally:
        first.stop()
    second = start_server(async_engine, api_keys=(KEY_A,), session_dir=tmp_path)
    try:
        after = get(second, session["id"])
        assert after["messages"] == before["messages"]
        reply = turn(second, session["id"], "How are you today?")
        assert len(get(second, session["id"])["messages"]) == 5
        assert cached(reply) >= reused_blocks_of(history_len(first_turn))  # the saved token ids still match
        ok(send(second, "DELETE", f"/v1/sessions/{session['id']}"))
        assert list(tmp_path.glob("*.json")) == []
    finally:
        second.stop()


def test_idle_sessions_expire(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), session_ttl=0.3)
    try:
        session = create(srv)
        deadline = time.monotonic() + 10
        while send(srv, "GET", f"/v1/sessions/{session['id']}").status == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert send(srv, "GET", f"/v1/sessions/{session['id']}").status == 404
    finally:
        srv.stop()
