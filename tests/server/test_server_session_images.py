"""Images in `/v1/sessions` through the real server (aiohttp on a loopback port), served by the tiny
Gemma 3 vision-language model: a session turn with an image replies as chat (the official `openai`
client) does with the same messages; later turns keep the image in their prompt (each url kept once
in the session's file, by its hash), reuse its KV from the prefix cache (pinned with the image's
digest, encoded once) and reply as the whole conversation sent statelessly as chat, across a restart
(`--session-dir`) too; edit, fork and the per-request image limit see the history's images."""

from __future__ import annotations

import json
import time

import openai
import pytest
from server_harness import KEY_A, MODEL_NAME, send, start_server, wait_until_idle
from test_server_images import ENGINE, REFERENCE, data_url, user_message

from checkpoints.tiny_vlm import build_tiny_vlm
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from server.auth import owner_id
from tests.data.vlm_images import image_png

GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def vlm():
    engine = LLMEngine(build_tiny_vlm(), EngineConfig(**ENGINE))
    engine.warm_up()
    ae = AsyncEngine(engine)
    ae.start()
    yield ae, engine, engine.num_compilations
    ae.shutdown()


@pytest.fixture
def served(vlm, tmp_path, assert_kv_all_free):
    """A server with session files, restarted by `restart()`; after the test, its sessions deleted
    and the KV pool all free."""
    ae, engine, compiled = vlm
    holder = {}

    def restart():
        if holder:
            holder["srv"].stop()
        holder["srv"] = start_server(ae, api_keys=(KEY_A,), session_dir=tmp_path, max_images_per_request=3)
        return holder["srv"]

    yield restart, tmp_path
    srv = holder["srv"]
    for session in ok(send(srv, "GET", "/v1/sessions"))["data"]:
        ok(send(srv, "DELETE", f"/v1/sessions/{session['id']}"))
    deadline = time.monotonic() + 120  # unpinning is queued behind the engine's steps
    while pinned_blocks(srv, ae) and time.monotonic() < deadline:
        time.sleep(0.05)
    wait_until_idle(srv, ae)
    srv.engine_call(ae, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])
    assert engine.num_compilations == compiled
    srv.stop()


def ok(reply):
    assert reply.status == 200, reply.text
    return reply.json


def pinned_blocks(srv, ae) -> int:
    return srv.engine_call(ae, lambda dp: sum(e.kv.leases.pinned_by(owner_id(KEY_A)) for e in dp.replicas))


def turn(srv, sid: str, content) -> dict:
    return ok(send(srv, "POST", f"/v1/sessions/{sid}/messages", {"role": "user", "content": content, **GREEDY}))


def stateless(srv, messages: list[dict]):
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)


def text_of(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def test_a_session_keeps_its_images_across_turns_and_a_restart(served, vlm):
    restart, directory = served
    srv, engine = restart(), vlm[1]
    case = REFERENCE["one_image"]
    first_message = user_message(case)[0]
    sid = ok(send(srv, "POST", "/v1/sessions", {}))["id"]
    first = turn(srv, sid, first_message["content"])
    chat = stateless(srv, [first_message])
    assert text_of(first) == chat.choices[0].message.content == engine.tokenizer.decode(case["new_ids"][:4])
    assert first["usage"]["prompt_tokens"] == chat.usage.prompt_tokens == len(case["prompt_ids"])
    image_end = len(case["prompt_ids"]) - case["prompt_ids"][::-1].index(engine.vision.image_token_id)
    deadline = time.monotonic() + 30
    while pinned_blocks(srv, vlm[0]) < image_end // 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pinned_blocks(srv, vlm[0]) >= image_end // 8  # the pin holds the image's blocks (keyed by its digest)

    history = [first_message, {"role": "assistant", "content": text_of(first)}]
    misses = engine.runner.vision.cache.misses
    second = turn(srv, sid, "And the colours?")
    history += [{"role": "user", "content": "And the colours?"}]
    chat = stateless(srv, history)
    assert text_of(second) == chat.choices[0].message.content
    assert second["usage"]["prompt_tokens"] == chat.usage.prompt_tokens
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= image_end
    assert engine.runner.vision.cache.misses == misses  # the image was not encoded again

    red = {"type": "image_url", "image_url": {"url": data_url(image_png("red"))}}
    again = [red, {"type": "text", "text": "Again?"}]
    third = turn(srv, sid, again)
    history += [{"role": "assistant", "content": text_of(second)}, {"role": "user", "content": again}]
    assert text_of(third) == stateless(srv, history).choices[0].message.content
    record = json.loads((directory / f"{sid}.json").read_text())
    assert list(record["images"].values()) == [data_url(image_png("red"))]  # kept once for two messages
    assert [len(m.get("images", ())) for m in record["messages"]] == [1, 0, 0, 0, 1, 0]

    srv = restart()
    history += [{"role": "assistant", "content": text_of(third)}, {"role": "user", "content": "And?"}]
    fourth = turn(srv, sid, "And?")
    chat = stateless(srv, history)
    assert text_of(fourth) == chat.choices[0].message.content
    assert fourth["usage"]["prompt_tokens"] == chat.usage.prompt_tokens


def test_edit_fork_and_the_image_limit_see_the_history_images(served, vlm):
    """A fork keeps the images of its messages; an edit before an image drops it from the session's
    urls; the history's images count with the new message's against --max-images-per-request (3)."""
    srv = served[0]()
    red, blue = data_url(image_png("red")), data_url(image_png("blue"))

    def parts(*urls: str) -> list[dict]:
        return [*({"type": "image_url", "image_url": {"url": url}} for url in urls), {"type": "text", "text": "Hi"}]

    start = [{"role": "user", "content": parts(red)}, {"role": "assistant", "content": "Red."}]
    sid = ok(send(srv, "POST", "/v1/sessions", {"messages": start}))["id"]
    reply = turn(srv, sid, parts(blue))
    fork = ok(send(srv, "POST", f"/v1/sessions/{sid}/fork", {"at": 2}))
    forked = turn(srv, fork["id"], "And?")
    assert text_of(forked) == stateless(srv, [*start, {"role": "user", "content": "And?"}]).choices[0].message.content

    too_many = send(srv, "POST", f"/v1/sessions/{sid}/messages", {"content": parts(red, blue), **GREEDY})
    assert too_many.status == 400 and "holds 2 images and the input 2" in too_many.json["error"]["message"]
    assert len(ok(send(srv, "GET", f"/v1/sessions/{sid}"))["messages"]) == 4  # unchanged

    edited = ok(send(srv, "PUT", f"/v1/sessions/{sid}/messages/2", {"content": "Hi", **GREEDY}))
    assert text_of(edited) == stateless(srv, [*start, {"role": "user", "content": "Hi"}]).choices[0].message.content
    record = json.loads((served[1] / f"{sid}.json").read_text())
    assert list(record["images"].values()) == [red]  # blue went with the edited message
    assert reply["usage"]["prompt_tokens"] > edited["usage"]["prompt_tokens"]


def test_a_bad_image_in_a_session_is_a_400_that_changes_nothing(served):
    srv = served[0]()
    sid = ok(send(srv, "POST", "/v1/sessions", {}))["id"]
    bad = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    reply = send(srv, "POST", f"/v1/sessions/{sid}/messages", {"content": bad, **GREEDY})
    assert reply.status == 400 and "remote image URLs are not fetched" in reply.json["error"]["message"]
    assert reply.json["error"]["param"] == "content"
    created = send(srv, "POST", "/v1/sessions", {"messages": [{"role": "user", "content": bad}]})
    assert created.status == 400 and created.json["error"]["param"] == "messages"
    assert ok(send(srv, "GET", f"/v1/sessions/{sid}"))["messages"] == []
