"""The tiny Gemma 3 vision-language model served by the engine reproduces transformers' greedy tokens
(f32; tests/data/vlm_reference.json, made by tests/data/make_vlm_reference.py from the same random
checkpoint and images): 1 and 2 images per prompt, with prefill chunks that would split an image's
tokens (the scheduler moves the boundary before the image, which is computed in one step: its rows
attend to each other both ways); a repeated image is encoded once (encoder cache) and its prompt's
blocks are found in the prefix cache; the same text with another image finds no block holding an
image row. No compilation after warm-up, and the KV pool is free after every test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoints.hf import save_hf_dir
from checkpoints.registry import load_model
from checkpoints.tiny_random import build_tiny_random
from checkpoints.tiny_vlm import build_tiny_vlm
from jaxserve import LLM, SamplingParams
from jaxserve.image_prompt import MultimodalPrompt, chunk_end, expand_images
from jaxserve.images import load_image
from tests.data.vlm_images import image_png

REFERENCE = json.loads((Path(__file__).parent / "data" / "vlm_reference.json").read_text())
CASES = {c["name"]: c for c in REFERENCE["cases"]}
# 24 tokens a step: the first chunk of every prompt would end inside its first image (rows 9-24).
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=24,
    max_model_len=192,
    block_size=8,
    num_blocks=96,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(32,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(24,),
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model = build_tiny_vlm()
    directory = tmp_path_factory.mktemp("tiny_vlm")
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, directory, vision=model.vision)
    return LLM(load_model(str(directory)), **ENGINE)


def prompt_of(llm: LLM, case: dict) -> MultimodalPrompt:
    engine = llm.engine
    size = engine.vision.image_size
    images = [load_image(image_png(name), size, 10**6) for name in case["images"]]
    text = engine.tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True)
    return expand_images(text, images, engine.tokenizer, engine.vision)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_prompts_expand_as_gemma3_processor(llm):
    for case in CASES.values():
        prompt = prompt_of(llm, case)
        assert prompt.token_ids == case["prompt_ids"], case["name"]
        assert len(prompt.images) == len(case["images"])


def test_greedy_tokens_match_transformers_with_no_compilation_after_warm_up(llm, assert_kv_all_free):
    compiled = llm.engine.num_compilations
    cases = list(CASES.values())
    outs = llm.generate([prompt_of(llm, c) for c in cases], greedy(len(cases[0]["new_ids"])), use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["new_ids"], case["name"]
    assert llm.engine.num_compilations == compiled
    assert_kv_all_free(llm.engine)


def test_repeated_image_is_encoded_once_and_its_blocks_are_reused(llm, assert_kv_all_free):
    case = CASES["one_image"]
    cache = llm.engine.runner.vision.cache
    [first] = llm.generate(prompt_of(llm, case), greedy(4), use_tqdm=False)
    hits, misses = cache.hits, cache.misses
    [again] = llm.generate(prompt_of(llm, case), greedy(len(case["new_ids"])), use_tqdm=False)
    assert again.outputs[0].token_ids == case["new_ids"]
    assert again.num_cached_tokens >= 32  # the blocks holding the image's rows (9-24) came from the cache
    assert (cache.hits, cache.misses) == (hits, misses)  # nothing left to encode: its rows were cached
    assert_kv_all_free(llm.engine)


def test_same_text_with_another_image_finds_no_image_block(llm, assert_kv_all_free):
    one = CASES["one_image"]  # its text is never sent with "green" elsewhere
    llm.generate(prompt_of(llm, one), greedy(2), use_tqdm=False)
    prompt = prompt_of(llm, {**one, "images": ["green"]})
    assert prompt.token_ids == one["prompt_ids"]  # the same tokens: only the image differs
    [out] = llm.generate(prompt, greedy(len(one["new_ids"])), use_tqdm=False)
    assert out.num_cached_tokens <= prompt.images[0].start  # at most the text before the image
    assert out.outputs[0].token_ids != one["new_ids"]
    assert_kv_all_free(llm.engine)


def test_a_text_model_refuses_images(llm):
    text_only = LLM(build_tiny_random(family="gemma3", vocab_size=320), warm_up=False, **ENGINE)  # refused at once
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate(prompt_of(llm, CASES["one_image"]), greedy(2), use_tqdm=False)


def test_a_step_must_hold_an_image():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(12\) must hold an image's 16 tokens"):
        LLM(build_tiny_vlm(), **{**ENGINE, "max_num_batched_tokens": 12, "prefill_token_buckets": (16,)})


def test_a_chunk_never_ends_inside_an_image():
    [image] = expand_images("<s>", [load_image(image_png("red"), 32, 10**6)], _Tok(), _Vision()).images
    assert (image.start, image.end) == (3, 19)  # after "\n\n<s>"
    assert chunk_end([image], 0, 10) == 3  # would split it: stops before it
    assert chunk_end([image], 3, 10) == 0  # starts at it and it does not fit: waits
    assert chunk_end([image], 0, 19) == 19 and chunk_end([image], 0, 3) == 3 and chunk_end([image], 5, 20) == 20


class _Vision:
    mm_tokens_per_image, boi_token_id, eoi_token_id, image_token_id = 16, 1, 2, 3


class _Tok:
    """A tokenizer of one character a token: "\\n" 0, markers 1-3, other characters 4."""

    MARKS = {"<s>": 1, "<e>": 2, "<i>": 3}

    def decode(self, ids, skip_special_tokens=True):
        return {v: k for k, v in self.MARKS.items()}[ids[0]]

    def encode(self, text, add_special_tokens=False):
        for mark, i in self.MARKS.items():
            text = text.replace(mark, chr(i))
        return [0 if ch == "\n" else ord(ch) if ord(ch) < 4 else 4 for ch in text]


def test_encoder_budget_spreads_a_prompts_images_over_steps(llm, assert_kv_all_free):
    """One image a step (`max_num_encoder_images=1`) in a step that holds the whole two-image prompt: its
    second image waits for the next step, each encoder call takes one image, the tokens are unchanged."""
    case = CASES["two_images"]
    budgeted = LLM(
        build_tiny_vlm(),
        **{**ENGINE, "max_num_batched_tokens": 96, "prefill_token_buckets": (96,)},
        max_num_encoder_images=1,
    )
    vision = budgeted.engine.runner.vision
    calls = []
    encode = vision.encode
    vision.encode = lambda images: calls.append(len(images)) or encode(images)
    [out] = budgeted.generate(prompt_of(llm, case), greedy(len(case["new_ids"])), use_tqdm=False)
    assert out.outputs[0].token_ids == case["new_ids"]
    assert calls == [1, 1]
    assert_kv_all_free(budgeted.engine)
