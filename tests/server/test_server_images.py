"""Images in chat through the real server (aiohttp on a loopback port) with the official `openai`
client, served by the tiny Gemma 3 vision-language model: the reply's text is transformers' greedy
tokens (tests/data/vlm_reference.json) for 1 and 2 images, streamed or not; file URLs only under
--allowed-local-media-path; bad images (not an image, truncated base64, too large, too many, a
remote URL) are clear 400s that leak nothing; no compilation after warm-up. The same images through
the Responses API (`input_image`, the `openai` client) and the Messages API (image blocks, the
`anthropic` SDK; in a tool result too) make chat's prompt and reply; their bad images are 400s in
each API's error shape; a stored response or a conversation with images goes on with them."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image
from server_harness import KEY_A, MODEL_NAME, send, start_server, wait_until_idle

from bench.http_client import Endpoint
from bench.image_workload import image_workload
from bench.load import LoadSpec, run_load
from bench.workloads import TokenSampler
from checkpoints.tiny_vlm import build_tiny_vlm
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from server.errors import APIError
from server.image_parts import ImageLimits, ImageParts
from server.messages_request import parse_conversation
from server.model_info import ModelInfo
from server.prompts import parse_messages
from server.state import STATE
from tests.data.vlm_images import image_png

REFERENCE = {
    c["name"]: c for c in json.loads((Path(__file__).parents[1] / "data" / "vlm_reference.json").read_text())["cases"]
}
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=192,
    block_size=8,
    num_blocks=128,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(24,),
)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    engine = LLMEngine(build_tiny_vlm(), EngineConfig(**ENGINE))
    engine.warm_up()
    compiled = engine.num_compilations
    ae = AsyncEngine(engine)
    ae.start()
    media = tmp_path_factory.mktemp("media")
    (media / "red.png").write_bytes(image_png("red"))
    srv = start_server(
        ae, api_keys=(KEY_A,), max_image_bytes=20_000, max_images_per_request=2, allowed_local_media_path=media
    )
    yield srv, ae, engine, compiled, media
    srv.stop()
    ae.shutdown()


@pytest.fixture
def client(vlm):
    return openai.OpenAI(base_url=vlm[0].base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def kv_free_after(vlm, assert_kv_all_free):
    yield
    srv, ae, engine, compiled, _ = vlm
    wait_until_idle(srv, ae)
    deadline = time.monotonic() + 60  # the pins of deleted responses are released behind the engine's steps
    while pinned_blocks(srv, ae) and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.engine_call(ae, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])
    assert engine.num_compilations == compiled


def pinned_blocks(srv, ae) -> int:
    return srv.engine_call(ae, lambda dp: sum(e.kv.usage().pinned for e in dp.replicas))


def case_parts(case: dict, text_part, image_part) -> list[dict]:
    """The case's user text as content parts: each <start_of_image> `image_part(name)`, in order,
    the (non-empty) texts around them `text_part(text)`."""
    pieces = case["messages"][0]["content"].split("<start_of_image>")
    parts: list[dict] = [text_part(pieces[0])] if pieces[0] else []
    for name, text in zip(case["images"], pieces[1:]):
        parts.append(image_part(name))
        parts += [text_part(text)] if text else []
    return parts


def user_message(case: dict, url_of=lambda name: data_url(image_png(name))) -> list[dict]:
    """The case's user message for chat completions."""
    parts = case_parts(
        case,
        lambda text: {"type": "text", "text": text},
        lambda name: {"type": "image_url", "image_url": {"url": url_of(name)}},
    )
    return [{"role": "user", "content": parts}]


def response_input(case: dict) -> list[dict]:
    """The case's user message as the Responses API's input."""
    parts = case_parts(
        case,
        lambda text: {"type": "input_text", "text": text},
        lambda name: {"type": "input_image", "image_url": data_url(image_png(name)), "detail": "auto"},
    )
    return [{"role": "user", "content": parts}]


def base64_block(png: bytes, media_type: str = "image/png") -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": base64.b64encode(png).decode()},
    }


def anthropic_messages(case: dict, block_of=lambda name: base64_block(image_png(name))) -> list[dict]:
    """The case's user message as the Messages API's."""
    parts = case_parts(case, lambda text: {"type": "text", "text": text}, block_of)
    return [{"role": "user", "content": parts}]


def expected_text(engine: LLMEngine, case: dict) -> str:
    return engine.tokenizer.decode(case["new_ids"])


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_chat_with_images_replies_transformers_tokens(client, vlm, name):
    case = REFERENCE[name]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=user_message(case), max_tokens=len(case["new_ids"]), temperature=0.0
    )
    assert out.choices[0].message.content == expected_text(vlm[2], case)
    assert out.usage.prompt_tokens == len(case["prompt_ids"])


def test_streamed_chat_with_an_image(client, vlm):
    case = REFERENCE["other_image"]
    chunks = client.chat.completions.create(
        model=MODEL_NAME, messages=user_message(case), max_tokens=len(case["new_ids"]), temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_text(vlm[2], case)


def test_a_file_url_is_read_only_inside_the_allowed_path(client, vlm):
    case, media = REFERENCE["one_image"], vlm[4]
    messages = user_message(case, lambda name: (media / f"{name}.png").as_uri())
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0.0)
    assert out.choices[0].message.content == vlm[2].tokenizer.decode(case["new_ids"][:4])
    outside = user_message(case, lambda name: Path(__file__).resolve().as_uri())
    with pytest.raises(openai.BadRequestError, match="no such file under the allowed local media path"):
        client.chat.completions.create(model=MODEL_NAME, messages=outside, max_tokens=4)


def noise_png(side: int) -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png;base64," + base64.b64encode(b"plain text, not a picture").decode(), "not a readable image"),
        (data_url(image_png("blue"))[:-9], "base64 data is invalid or truncated"),
        (data_url(noise_png(64)[:2000]), "not a readable image"),  # a truncated file
        (data_url(noise_png(100)), "at most 20000"),
        ("https://example.com/cat.png", "remote image URLs are not fetched"),
        ("ftp://example.com/cat.png", "unsupported image URL scheme"),
    ],
)
def test_bad_images_are_clear_400s(vlm, url, message):
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
    messages = [{"role": "user", "content": parts}]
    reply = send(vlm[0], "POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 2})
    assert reply.status == 400, reply.text
    error = reply.json["error"]
    assert message in error["message"] and error["param"] == "messages"


def test_too_many_images_are_a_400(vlm):
    part = {"type": "image_url", "image_url": {"url": data_url(image_png("red"))}}
    messages = [{"role": "user", "content": [part, part, part]}]
    reply = send(vlm[0], "POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 2})
    assert reply.status == 400 and "at most 2 images per request" in reply.json["error"]["message"]


def test_a_text_model_refuses_image_parts(vlm):
    engine = vlm[2]
    info = ModelInfo("text", engine.tokenizer, 320, 192, 4, 8, 64, 0)  # no vision tower
    parts = [{"type": "image_url", "image_url": {"url": data_url(image_png("red"))}}]
    with pytest.raises(APIError, match="this model takes no images") as raised:
        parse_messages([{"role": "user", "content": parts}], images=ImageParts(info, ImageLimits()))
    assert raised.value.status == 400


def test_a_conversation_about_one_image_reuses_its_encoding_and_blocks(client, vlm):
    """The second turn resends the image (chat is stateless): the prefix cache holds the first
    turn's blocks, the image's rows included, so the image is not encoded again."""
    case, cache = REFERENCE["image_late"], vlm[2].runner.vision.cache
    messages = user_message(case)
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0.0)
    misses = cache.misses
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the colours?"},
    ]
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0.0)
    assert cache.misses == misses  # not encoded again
    image_end = len(case["prompt_ids"]) - case["prompt_ids"][::-1].index(vlm[2].vision.image_token_id)
    assert second.usage.prompt_tokens_details.cached_tokens >= image_end


def test_the_bench_image_workload_runs_against_the_server(vlm):
    """`jaxserve bench serve --workload images`'s requests (1 and 2 images each here) all succeed."""
    srv, _, engine, _, _ = vlm
    special = {0, 1, 2, *range(300, 320)}  # the tiny tokenizer's special, turn and image tokens
    workload = image_workload(TokenSampler(engine.tokenizer, 0, special), 4, 8, 3, max_images=2, image_side=48)
    endpoint = Endpoint(srv.base_url, MODEL_NAME, api_key=KEY_A)
    records, _ = asyncio.run(run_load(endpoint, workload, LoadSpec(), engine.tokenizer, show_progress=False))
    assert all(r.success for r in records), [r.error for r in records]
    assert sorted(r.group for r in records) == ["1-images", "1-images", "2-images", "2-images"]
    assert all(r.prompt_tokens >= 22 * int(r.group[0]) and r.output_tokens == 3 for r in records)


def greedy_chat(client, messages: list[dict], max_tokens: int, **kw):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0.0, **kw
    )


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_responses_with_images_reply_as_chat(client, vlm, name):
    case = REFERENCE[name]
    chat = greedy_chat(client, user_message(case), len(case["new_ids"]))
    out = client.responses.create(
        model=MODEL_NAME,
        input=response_input(case),
        max_output_tokens=len(case["new_ids"]),
        temperature=0.0,
        store=False,
    )
    assert out.output_text == chat.choices[0].message.content == expected_text(vlm[2], case)
    assert out.usage.input_tokens == chat.usage.prompt_tokens == len(case["prompt_ids"])


def test_a_chain_and_a_conversation_carry_their_images(client, vlm):
    """A stored response with an image (streamed; its input items show it) goes on with text alone
    (`previous_response_id`), and so does a conversation holding it and the reply: each replies as
    the whole conversation sent as input, images included (same tokens, same prompt), starting from
    the cached prefix of the first turn. A chain's images count against the per-request limit; a
    deleted response's are gone with it."""
    case, greedy = REFERENCE["other_image"], dict(model=MODEL_NAME, max_output_tokens=4, temperature=0.0)
    events = list(client.responses.create(input=response_input(case), stream=True, **greedy))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == vlm[2].tokenizer.decode(
        case["new_ids"][:4]
    )
    first = events[-1].response
    deadline = time.monotonic() + 30
    while pinned_blocks(vlm[0], vlm[1]) < 25 // 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pinned_blocks(vlm[0], vlm[1]) >= 25 // 8  # the chain's pin holds the image's rows (9-24)
    image = client.responses.input_items.list(first.id).data[0].content[0]
    assert image.type == "input_image" and image.image_url == data_url(image_png("blue"))
    follow = [{"role": "user", "content": "And the colours?"}]
    chained = client.responses.create(input=follow, previous_response_id=first.id, **greedy)
    assert chained.usage.input_tokens_details.cached_tokens >= len(case["prompt_ids"]) // 8 * 8
    history = [*response_input(case), {"role": "assistant", "content": first.output_text}]
    conv = client.conversations.create(items=history)
    in_conversation = client.responses.create(input=follow, conversation=conv.id, store=False, **greedy)
    whole = client.responses.create(input=[*history, *follow], store=False, **greedy)
    for out in (chained, in_conversation):
        assert out.output_text == whole.output_text and out.usage.input_tokens == whole.usage.input_tokens
    assert in_conversation.usage.input_tokens_details.cached_tokens > 0
    two = [{"role": "user", "content": [{"type": "input_image", "image_url": RED}] * 2}]
    with pytest.raises(openai.BadRequestError, match="at most 2 images per request") as refused:
        client.responses.create(input=two, previous_response_id=chained.id, **greedy)
    assert refused.value.body["param"] == "previous_response_id"
    for response in (first, chained):
        client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input=follow, previous_response_id=chained.id, **greedy)
    client.conversations.delete(conv.id)


def test_a_chain_keeps_its_images_once_each_across_a_restart(vlm, tmp_path):
    """With --session-dir a chain's images are written with its stored responses (an image sent
    twice is kept once), survive a restart, and go when the responses are deleted."""
    ae = vlm[1]
    case, greedy = REFERENCE["other_image"], dict(model=MODEL_NAME, max_output_tokens=2, temperature=0.0)
    again = [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(image_png("blue"))}]}]
    turns: list = []
    stored = start_server(ae, api_keys=(KEY_A,), session_dir=tmp_path, max_images_per_request=2)
    try:
        client = openai.OpenAI(base_url=stored.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
        turns.append(client.responses.create(input=response_input(case), **greedy))
        turns.append(client.responses.create(input=again, previous_response_id=turns[0].id, **greedy))
    finally:
        deadline = time.monotonic() + 30  # the pins made after the replies, which the stop releases
        while stored.app[STATE].background and time.monotonic() < deadline:
            time.sleep(0.05)
        stored.stop()
    kept = json.loads((tmp_path / f"{turns[1].id}.json").read_text())["response"]["context_images"]
    assert len(kept["order"]) == 2 and list(kept["urls"].values()) == [data_url(image_png("blue"))]
    stored = start_server(ae, api_keys=(KEY_A,), session_dir=tmp_path, max_images_per_request=2)
    try:
        client = openai.OpenAI(base_url=stored.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
        follow = [{"role": "user", "content": "And?"}]
        chained = client.responses.create(input=follow, previous_response_id=turns[1].id, store=False, **greedy)
        history = [*response_input(case), {"role": "assistant", "content": turns[0].output_text}]
        whole = [*history, *again, {"role": "assistant", "content": turns[1].output_text}, *follow]
        expected = client.responses.create(input=whole, store=False, **greedy)
        assert chained.output_text == expected.output_text and chained.usage.input_tokens == expected.usage.input_tokens
        for response in turns:
            client.responses.delete(response.id)
        assert not list(tmp_path.glob("resp_*.json"))
    finally:
        stored.stop()


@pytest.fixture
def claude(vlm):
    return anthropic.Anthropic(base_url=vlm[0].base_url, api_key=KEY_A, max_retries=0, timeout=60)


@pytest.mark.parametrize("name, stream", [("one_image", True), ("two_images", False)])
def test_messages_with_images_reply_as_chat(client, claude, vlm, name, stream):
    """Base64 sources, or streamed, a url source (a file under the allowed path)."""
    case, media = REFERENCE[name], vlm[4]
    chat = greedy_chat(client, user_message(case), len(case["new_ids"]))

    def by_url(name: str) -> dict:
        return {"type": "image", "source": {"type": "url", "url": (media / f"{name}.png").as_uri()}}

    messages = anthropic_messages(case, by_url) if stream else anthropic_messages(case)
    request = dict(model=MODEL_NAME, messages=messages, max_tokens=len(case["new_ids"]), extra_body={"temperature": 0})
    if stream:
        with claude.messages.stream(**request) as events:
            text = "".join(events.text_stream)
            message = events.get_final_message()
    else:
        message = claude.messages.create(**request)
        text = "".join(block.text for block in message.content)
    assert text == chat.choices[0].message.content == expected_text(vlm[2], case)
    prompt_tokens = message.usage.input_tokens + message.usage.cache_read_input_tokens  # (Anthropic's split)
    assert prompt_tokens == chat.usage.prompt_tokens == len(case["prompt_ids"])
    counted = claude.messages.count_tokens(model=MODEL_NAME, messages=messages)
    assert counted.input_tokens == len(case["prompt_ids"])


def test_an_image_in_a_messages_tool_result_takes_its_place_in_the_tool_message(vlm):
    """(Gemma 3's chat template renders no tool messages: only their parsing is checked here.)"""
    engine, url = vlm[2], (vlm[4] / "red.png").as_uri()
    info = ModelInfo("vlm", engine.tokenizer, 320, 192, 4, 8, 64, 0, vision=engine.vision)
    images = ImageParts(info, ImageLimits())
    image = {"type": "image", "source": {"type": "url", "url": url}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Here:"}, image]}
    messages = [
        {"role": "user", "content": "Show me."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_picture", "input": {}}]},
        {"role": "user", "content": [result]},
    ]
    conversation = parse_conversation({"messages": messages}, images=images)
    assert conversation.messages[-1] == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "Here:\n<start_of_image>",
    }
    assert images.urls == [url]


RED = data_url(image_png("red"))
BAD_INPUT_IMAGES = {
    "a remote url": (
        {"type": "input_image", "image_url": "https://example.com/cat.png"},
        "remote image URLs are not fetched",
    ),
    "bad base64": ({"type": "input_image", "image_url": RED[:-9]}, "base64 data is invalid or truncated"),
    "a file id": ({"type": "input_image", "file_id": "file-123"}, "file_id is not supported"),
    "an unknown detail": ({"type": "input_image", "image_url": RED, "detail": "max"}, "detail must be one of"),
}


@pytest.mark.parametrize("part, message", BAD_INPUT_IMAGES.values(), ids=BAD_INPUT_IMAGES)
def test_bad_input_images_are_responses_400s(vlm, part, message):
    content = [part, {"type": "input_text", "text": "hi"}]
    body = {"model": MODEL_NAME, "input": [{"role": "user", "content": content}], "max_output_tokens": 2}
    reply = send(vlm[0], "POST", "/v1/responses", body)
    assert reply.status == 400, reply.text
    assert message in reply.json["error"]["message"] and reply.json["error"]["param"] == "input", reply.json


def test_too_many_images_are_responses_and_conversations_400s(vlm):
    part = {"type": "input_image", "image_url": RED}
    items = [{"role": "user", "content": [part, part, part]}]
    for path, body, param in (
        ("/v1/responses", {"model": MODEL_NAME, "input": items, "max_output_tokens": 2}, "input"),
        ("/v1/conversations", {"items": items}, "items"),
    ):
        reply = send(vlm[0], "POST", path, body)
        assert reply.status == 400 and reply.json["error"]["param"] == param, reply.text
        assert "at most 2 images per request" in reply.json["error"]["message"]


BAD_IMAGE_BLOCKS = {
    "a remote url": (
        [{"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}],
        "remote image URLs are not fetched",
    ),
    "bad base64": (
        [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": RED[-20:-9]}}],
        "base64 data is invalid or truncated",
    ),
    "not an image type": ([base64_block(image_png("red"), "application/pdf")], "media_type must be one of"),
    "no source": ([{"type": "image"}], "source must be"),
    "too many": ([base64_block(image_png("red"))] * 3, "at most 2 images per request"),
    "a document": ([{"type": "document", "source": {"type": "text", "data": "x"}}], "document content blocks"),
}


@pytest.mark.parametrize("blocks, message", BAD_IMAGE_BLOCKS.values(), ids=BAD_IMAGE_BLOCKS)
def test_bad_image_blocks_are_anthropic_400s(vlm, blocks, message):
    body = {
        "model": MODEL_NAME,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [*blocks, {"type": "text", "text": "hi"}]}],
    }
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        reply = send(
            vlm[0],
            "POST",
            path,
            body if path == "/v1/messages" else {k: v for k, v in body.items() if k != "max_tokens"},
        )
        assert reply.status == 400, reply.text
        assert reply.json["type"] == "error" and set(reply.json["error"]) == {"type", "message"}, reply.json
        assert reply.json["error"]["type"] == "invalid_request_error" and message in reply.json["error"]["message"]
