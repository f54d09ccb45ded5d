"""A chat with two images through the real server (aiohttp on a loopback port) with the official
`openai` client, served by the tiny SmolVLM: the images are split into tiles and the prompt
expanded as SmolVLM's processor does it, and the reply's text is transformers' greedy tokens
(tests/data/smolvlm_reference.json); no compilation after warm-up, the KV pool free after."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import openai
import pytest
from server_harness import KEY_A, MODEL_NAME, start_server, wait_until_idle

from checkpoints.tiny_smolvlm import build_tiny_smolvlm
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from tests.data.vlm_images import image_png

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "smolvlm_reference.json").read_text())
ENGINE = dict(
    max_num_seqs=2,
    max_num_batched_tokens=64,
    max_model_len=192,
    block_size=8,
    num_blocks=64,
    decode_batch_buckets=(2,),
    sampler_row_buckets=(2,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(2,),
    block_table_buckets=(24,),
)


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine(build_tiny_smolvlm(), EngineConfig(**ENGINE))
    engine.warm_up()
    ae = AsyncEngine(engine)
    ae.start()
    srv = start_server(ae, api_keys=(KEY_A,))
    yield srv, ae, engine
    srv.stop()
    ae.shutdown()


def test_chat_with_two_images_replies_transformers_tokens(served, assert_kv_all_free):
    srv, ae, engine = served
    compiled = engine.num_compilations
    case = next(c for c in REFERENCE["cases"] if c["name"] == "two_images")
    pieces = case["messages"][0]["content"].split("<image>")  # "Compare <image> with <image> please."
    url = {name: "data:image/png;base64," + base64.b64encode(image_png(name)).decode() for name in case["images"]}
    content = [{"type": "text", "text": pieces[0]}]
    for name, text in zip(case["images"], pieces[1:]):
        content += [{"type": "image_url", "image_url": {"url": url[name]}}, {"type": "text", "text": text}]
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=len(case["new_ids"]),
        temperature=0.0,
    )
    assert out.usage.prompt_tokens == len(case["prompt_ids"])
    assert out.choices[0].message.content == engine.tokenizer.decode(case["new_ids"])
    wait_until_idle(srv, ae)
    srv.engine_call(ae, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])
    assert engine.num_compilations == compiled
