"""The Conversations API (`/v1/conversations`) and responses made in a conversation, on the tiny
random model through the official openai client: the conversation and its items (create, retrieve,
update, list, add, delete), a response that reads them as its context and adds its input and output
to them, the errors of unknown ids and of `conversation` with `previous_response_id`, per-key
isolation, and a conversation that survives a restart. The KV pool is all free after each test."""

from __future__ import annotations

import json
import time

import openai
import pytest
from server_harness import KEY_A, KEY_B, MODEL_NAME, delete_stored_responses, send, start_server, wait_until_idle

from server.state import STATE

GREEDY = dict(model=MODEL_NAME, temperature=0, max_output_tokens=8)

pytestmark = pytest.mark.usefixtures("stored_responses_cleared")


def _texts(items) -> list[tuple[str, str, str]]:
    return [(i.type, i.role, i.content[0].text) for i in items]


def test_a_conversation_and_its_items(client):
    first = {"type": "message", "role": "user", "content": "Hello"}
    conv = client.conversations.create(items=[first], metadata={"topic": "demo"})
    assert conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"topic": "demo"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    updated = client.conversations.update(conv.id, metadata={"topic": "other"})
    assert (
        updated.metadata == {"topic": "other"} and client.conversations.retrieve(conv.id).metadata == updated.metadata
    )
    added = client.conversations.items.create(
        conv.id,
        items=[
            {"type": "message", "role": "assistant", "content": "Hi!"},
            {"type": "message", "role": "user", "content": "How are you?"},
        ],
    )
    assert _texts(added.data) == [("message", "assistant", "Hi!"), ("message", "user", "How are you?")]
    listed = client.conversations.items.list(conv.id, order="asc")
    assert _texts(listed.data) == [("message", "user", "Hello"), *_texts(added.data)] and not listed.has_more
    newest = client.conversations.items.list(conv.id, limit=1)
    assert _texts(newest.data) == [("message", "user", "How are you?")] and newest.has_more
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc", after=listed.data[0].id).data] == [
        i.id for i in added.data
    ]
    one = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert one.model_dump() == added.data[0].model_dump()
    after_delete = client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert after_delete.id == conv.id
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc").data] == [
        listed.data[0].id,
        added.data[1].id,
    ]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id and deleted.object == "conversation.deleted"
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_a_response_reads_the_conversation_and_adds_its_items(client):
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}])
    first = client.responses.create(input="What is my name?", conversation=conv.id, **GREEDY)
    assert first.conversation.id == conv.id
    items = client.conversations.items.list(conv.id, order="asc").data
    assert _texts(items[:2]) == [("message", "user", "My name is Ada."), ("message", "user", "What is my name?")]
    assert [i.id for i in items[2:]] == [o.id for o in first.output] and items[2].content[0].text == first.output_text
    # The same context sent as input gives the same prompt and reply.
    as_input = [i.model_dump(exclude_none=True) for i in items]
    second = client.responses.create(input="And again?", conversation={"id": conv.id}, **GREEDY)
    plain = client.responses.create(input=[*as_input, {"role": "user", "content": "And again?"}], store=False, **GREEDY)
    assert second.usage.input_tokens == plain.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == plain.output_text
    assert len(client.conversations.items.list(conv.id, limit=100).data) == len(items) + 1 + len(second.output)
    client.conversations.delete(conv.id)


def test_unknown_ids_are_404s_and_conversation_excludes_previous_response_id(client, server):
    missing = "conv_" + "0" * 24
    for method, path in (
        ("GET", f"/v1/conversations/{missing}"),
        ("DELETE", f"/v1/conversations/{missing}"),
        ("GET", f"/v1/conversations/{missing}/items"),
        ("GET", f"/v1/conversations/{missing}/items/msg_1"),
    ):
        reply = send(server, method, path)
        assert reply.status == 404 and reply.json["error"]["type"] == "not_found_error", (path, reply.text)
        assert reply.json["error"]["code"] == "conversation_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="x", conversation=missing, **GREEDY)
    assert e.value.body["param"] == "conversation"
    conv = client.conversations.create()
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.delete("msg_nope", conversation_id=conv.id)
    earlier = client.responses.create(input="Hi", **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="x", conversation=conv.id, previous_response_id=earlier.id, **GREEDY)
    assert e.value.body["param"] == "conversation"
    other = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.conversations.retrieve(conv.id)  # another key's conversation does not exist for it
    client.conversations.delete(conv.id)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("", {"items": "hello"}, "items"),
        ("", {"items": [{"type": "input_image", "image_url": "x"}]}, "items"),
        ("", {"metadata": {"k": 1}}, "metadata"),
        ("", {"name": "x"}, "name"),
        ("/items", {}, "items"),
        ("/items", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
        ("/items", {"items": [{"role": "wizard", "content": "x"}]}, "items"),
        ("/items", {"items": [{"id": "msg_1", "role": "user", "content": "x"}] * 2}, "items"),
        ("/update", {}, "metadata"),
    ],
)
def test_bad_conversation_requests_are_400s_naming_the_field(server, path, body, param):
    conv = send(server, "POST", "/v1/conversations", {}).json["id"]
    url = "/v1/conversations" if not path else f"/v1/conversations/{conv}" + ("" if path == "/update" else path)
    reply = send(server, "POST", url, body)
    assert reply.status == 400 and reply.json["error"]["param"] == param, reply.text
    assert send(server, "DELETE", f"/v1/conversations/{conv}").status == 200


def test_a_conversation_survives_a_restart(async_engine, tmp_path):
    srv = start_server(async_engine, api_keys=(KEY_A,), session_dir=tmp_path)
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
        conv = client.conversations.create(items=[{"role": "user", "content": "Remember 7."}], metadata={"a": "b"})
        client.responses.create(input="What number?", conversation=conv.id, store=False, **GREEDY)
        items = client.conversations.items.list(conv.id).model_dump()
        wait_until_idle(srv, async_engine)
        while srv.app[STATE].background:  # the pin made after the reply (stopping the server releases it)
            time.sleep(0.05)
    finally:
        srv.stop()
    srv = start_server(async_engine, api_keys=(KEY_A,), session_dir=tmp_path)
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
        assert client.conversations.retrieve(conv.id).metadata == {"a": "b"}
        assert client.conversations.items.list(conv.id).model_dump() == items
        client.conversations.delete(conv.id)
        assert not list(tmp_path.glob("conv_*.json"))
    finally:
        srv.stop()


def test_truncation_auto_keeps_a_long_conversation_within_the_message_limit(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), max_session_messages=6)
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}."} for i in range(8)]
        conv = client.conversations.create(items=turns)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(input="Next?", conversation=conv.id, **GREEDY)
        assert e.value.body["param"] == "input"
        kept = client.responses.create(input="Next?", conversation=conv.id, truncation="auto", **GREEDY)
        newest = client.responses.create(
            input=[*turns[-4:], {"role": "user", "content": "Next?"}], store=False, **GREEDY
        )
        assert kept.usage.input_tokens == newest.usage.input_tokens  # the newest 4 turns, the input and the reply: 6
        assert len(client.conversations.items.list(conv.id, limit=100).data) == 8 + 1 + len(kept.output)
        delete_stored_responses(srv)
    finally:
        srv.stop()


def test_conversation_files_that_do_not_load_are_quarantined(async_engine, tmp_path):
    from server.auth import owner_id

    good_id, bad_id = "conv_" + "a" * 24, "conv_" + "b" * 24
    conversation = {"id": good_id, "object": "conversation", "created_at": 1_700_000_000, "metadata": {}}
    record = {
        "id": good_id,
        "owner": owner_id(KEY_A),
        "model": MODEL_NAME,
        "created_at": 1_700_000_000,
        "last_used": time.time(),
        "defaults": {},
        "messages": [],
        "response": {"object": conversation, "items": [], "chain": good_id},
    }
    (tmp_path / f"{good_id}.json").write_text(json.dumps(record))
    bad = {**record, "id": bad_id, "response": {"object": conversation, "chain": bad_id}}  # no items
    (tmp_path / f"{bad_id}.json").write_text(json.dumps(bad))
    srv = start_server(async_engine, api_keys=(KEY_A,), session_dir=tmp_path)
    try:
        assert send(srv, "GET", f"/v1/conversations/{good_id}").json == conversation
        assert send(srv, "GET", f"/v1/conversations/{bad_id}").status == 404
        assert [p.stem for p in (tmp_path / "quarantine").iterdir()] == [bad_id]
        assert send(srv, "GET", f"/v1/responses/{good_id}").status == 404  # not a response
    finally:
        srv.stop()
