"""The tiny SmolVLM served by the engine reproduces transformers' greedy tokens (f32;
tests/data/smolvlm_reference.json, made by tests/data/make_smolvlm_reference.py from the same
random checkpoint and images): the images split into tiles as SmolVLM's processor splits them,
their pixels and the tower's tokens equal transformers', prompts expand as its processor does,
1 and 2 images per prompt, with prefill chunks that end inside a tile's rows (the Llama model
attends to them causally); a repeated image is encoded once (encoder cache) and its prompt's
blocks are found in the prefix cache; the same text with another image finds no block holding
an image row. No compilation after warm-up, and the KV pool is free after every test.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from checkpoints.hf import save_hf_dir
from checkpoints.registry import load_model
from checkpoints.tiny_smolvlm import build_tiny_smolvlm
from jaxserve import LLM, SamplingParams
from jaxserve.image_prompt import MultimodalPrompt
from jaxserve.model.vision import image_embeddings
from jaxserve.tiled_prompt import image_text
from jaxserve.vision_inputs import expand_pictures, load_picture
from tests.data.vlm_images import SIZES, image_png

REFERENCE = json.loads((Path(__file__).parent / "data" / "smolvlm_reference.json").read_text())
CASES = {c["name"]: c for c in REFERENCE["cases"]}
STEP = 16  # tokens a step: a single prompt's chunks end at multiples of it, inside tiles' rows
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=STEP,
    max_model_len=192,
    block_size=8,
    num_blocks=96,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(STEP,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(24,),
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model = build_tiny_smolvlm()
    directory = tmp_path_factory.mktemp("tiny_smolvlm")
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, directory, vision=model.vision)
    return LLM(load_model(str(directory)), **ENGINE)


def prompt_of(llm: LLM, case: dict) -> MultimodalPrompt:
    engine = llm.engine
    images = [load_picture(image_png(name), engine.vision, 10**6) for name in case["images"]]
    text = engine.tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True)
    return expand_pictures(text, images, engine.tokenizer, engine.vision)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_tiles_and_their_tokens_equal_transformers(llm, name):
    vision = llm.engine.vision
    image = load_picture(image_png(name), vision, 10**6)
    want = REFERENCE["pixels"][name]
    assert (image.rows, image.cols, len(image.tiles)) == (want["rows"], want["cols"], want["tiles"])
    pixels = np.stack([tile.pixels for tile in image.tiles])
    np.testing.assert_allclose(pixels[[0, -1], :, :2, :2], want["corners"], atol=1e-6)
    assert abs(float(pixels.mean()) - want["mean"]) < 1e-6
    tower = llm.engine.runner.vision
    out = np.asarray(jax.jit(image_embeddings, static_argnums=0)(vision, tower.params, pixels))
    embeddings = REFERENCE["image_embeddings"][name]
    assert out.shape == (len(image.tiles), 4, 64)
    np.testing.assert_allclose(out[[0, -1], 0, :8], embeddings["first"], atol=2e-5)
    assert abs(float(out.sum()) - embeddings["sum"]) < 1e-3


@pytest.mark.parametrize("name", sorted(SIZES))
def test_an_unsplit_image_is_one_tile_as_transformers(llm, name):
    vision = dataclasses.replace(llm.engine.vision, do_image_splitting=False)
    image = load_picture(image_png(name), vision, 10**6)
    want = REFERENCE["unsplit"][name]
    assert (image.rows, image.cols, len(image.tiles)) == (0, 0, 1)
    np.testing.assert_allclose(image.tiles[0].pixels[:, :2, :2], want["corner"], atol=1e-6)
    assert abs(float(image.tiles[0].pixels.mean()) - want["mean"]) < 1e-6
    marker = "<fake_token_around_image>"
    assert image_text(image, "<image>", 4) == f"{marker}<global-img>{'<image>' * 4}{marker}"


def test_prompts_expand_as_smolvlm_processor(llm):
    for case in CASES.values():
        prompt = prompt_of(llm, case)
        assert prompt.token_ids == case["prompt_ids"], case["name"]
        tiles = sum(REFERENCE["pixels"][name]["tiles"] for name in case["images"])
        assert len(prompt.images) == tiles and not any(image.bidirectional for image in prompt.images)


def test_greedy_tokens_match_transformers_with_chunks_inside_tiles(llm, assert_kv_all_free):
    compiled = llm.engine.num_compilations
    cases = list(CASES.values())
    prompts = [prompt_of(llm, c) for c in cases]
    for case, prompt in zip(cases, prompts):  # one at a time: chunks of STEP from its first uncached token
        [out] = llm.generate(prompt, greedy(len(case["new_ids"])), use_tqdm=False)
        assert out.outputs[0].token_ids == case["new_ids"], case["name"]
        ends = range(out.num_cached_tokens + STEP, len(prompt.token_ids), STEP)
        assert any(t.start < k < t.end for t in prompt.images for k in ends), case["name"]  # a chunk ended in a tile
    outs = llm.generate(prompts, greedy(len(cases[0]["new_ids"])), use_tqdm=False)  # batched
    assert [o.outputs[0].token_ids for o in outs] == [c["new_ids"] for c in cases]
    assert llm.engine.num_compilations == compiled
    assert_kv_all_free(llm.engine)


def test_repeated_image_is_encoded_once_and_its_blocks_are_reused(llm, assert_kv_all_free):
    case = CASES["image_late"]
    cache = llm.engine.runner.vision.cache
    llm.generate(prompt_of(llm, case), greedy(2), use_tqdm=False)
    misses = cache.misses
    prompt = prompt_of(llm, case)
    [again] = llm.generate(prompt, greedy(len(case["new_ids"])), use_tqdm=False)
    assert again.outputs[0].token_ids == case["new_ids"]
    assert again.num_cached_tokens >= prompt.images[-1].end  # every tile's rows came from the prefix cache
    hits = cache.hits
    other_text = {"messages": [{"role": "user", "content": "<image>Again?"}], "images": ["green"]}
    [out] = llm.generate(prompt_of(llm, other_text), greedy(2), use_tqdm=False)
    assert out.num_cached_tokens < 8  # a new prompt: its tiles' rows are computed...
    assert cache.misses == misses  # ...from tiles encoded before (found once a step: a split tile twice)
    assert cache.hits - hits >= len(prompt.images)
    assert_kv_all_free(llm.engine)


def test_same_text_with_another_image_finds_no_image_block(llm, assert_kv_all_free):
    two = CASES["two_images"]  # its text is never sent with "blue" first elsewhere
    llm.generate(prompt_of(llm, two), greedy(2), use_tqdm=False)
    prompt = prompt_of(llm, {**two, "images": ["blue", "green"]})
    assert prompt.token_ids == two["prompt_ids"]  # "red" and "blue" both take 3 x 3 tiles: the same tokens
    [out] = llm.generate(prompt, greedy(len(two["new_ids"])), use_tqdm=False)
    assert out.num_cached_tokens <= prompt.images[0].start  # at most the text before the first tile
    assert out.outputs[0].token_ids != two["new_ids"]
    assert_kv_all_free(llm.engine)
