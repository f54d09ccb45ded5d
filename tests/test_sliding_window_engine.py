"""A sliding-window model (tiny Mistral, a window of 8 tokens) served with window-sized caches
(jaxserve/kv/window.py) answers the tokens of the whole-cache path (`sliding_window_kv=False`) and
of transformers (tests/data/family_reference.json), on prompts longer than the window and than a
prefill chunk; a sequence decoding past its window holds a bounded number of blocks; a prefix hit on
a long shared prefix, and preemption by recompute and by swap, answer the same tokens; nothing
compiles after warm-up and the pool is free after each test."""

from __future__ import annotations

import numpy as np
import pytest
from sliding_window_harness import BS, CONFIG, LONG, REFERENCE, WINDOW, tiny_mistral

from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_mistral()


@pytest.fixture(scope="module")
def whole(model):
    """The whole-cache path: every block of a sequence kept."""
    llm = LLM(model, sliding_window_kv=False, **CONFIG)
    assert llm.engine.kv.window.size is None
    return llm


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def one_by_one(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [generate(llm, [p], n)[0] for p in prompts]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_window_cache_answers_transformers_and_the_whole_cache(model, whole, prefix_caching, assert_kv_all_free):
    llm = LLM(model, enable_prefix_caching=prefix_caching, **CONFIG)
    assert llm.engine.config.kv_window == WINDOW and llm.engine.kv.window.size == WINDOW
    compiled = llm.engine.num_compilations
    cases = REFERENCE["cases"]
    new = len(cases[0]["new_ids"])
    assert generate(llm, [c["prompt_ids"] for c in cases], new) == [c["new_ids"] for c in cases]
    assert generate(llm, [LONG], 60) == generate(whole, [LONG], 60)
    assert llm.engine.num_compilations == compiled
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_blocks_held_stay_bounded_while_decoding_past_the_window(model, prefix_caching, assert_kv_all_free):
    """Past its window a sequence holds the window's blocks only (the rest free, or cached and
    evictable); while it prefills, the window's too without prefix caching, its prompt's with it
    (cached, locked by it until the window has left them)."""
    llm = LLM(model, enable_prefix_caching=prefix_caching, **CONFIG)
    engine, kv = llm.engine, llm.engine.kv
    (req,) = engine.add_prompt_ids("long", LONG, greedy(60))
    most_in_prefill = most_in_decode = 0
    while engine.has_unfinished_requests():
        engine.step()
        used = kv.usage().used  # blocks the sequence holds, or locks in the prefix cache
        if req.kv is None or not req.kv.is_live:
            continue
        assert used >= len(req.kv.held_blocks) and kv.num_available_blocks == kv.pool.num_usable - used
        if req.num_computed_tokens <= len(LONG):
            most_in_prefill = max(most_in_prefill, used)
        elif req.num_computed_tokens > len(LONG) + WINDOW + BS:  # its prompt's blocks left the window
            assert used == len(req.kv.held_blocks)
            most_in_decode = max(most_in_decode, used)
    # The window's keys and the block the next token goes into (the step in flight's are in the window).
    assert most_in_decode <= WINDOW // BS + 2
    assert most_in_prefill <= (len(LONG) // BS + 1 if prefix_caching else WINDOW // BS + 2)
    assert len(req.output_token_ids) == 60 and 116 // BS > 2 * most_in_decode
    assert_kv_all_free(engine)


def test_a_prefix_hit_on_a_long_shared_prefix_answers_the_same(model, whole, assert_kv_all_free):
    llm = LLM(model, **CONFIG)
    compiled = llm.engine.num_compilations
    shared = LONG[:48] + [5, 6, 7, 8, 9, 10]
    prompts = [LONG, shared]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], greedy(30), use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy(30), use_tqdm=False)
    assert outs[1].num_cached_tokens == 48 > WINDOW
    assert [o.outputs[0].token_ids for o in outs] == one_by_one(whole, prompts, 30)
    assert llm.engine.num_compilations == compiled
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_answers_the_same(model, whole, mode, assert_kv_all_free):
    swap = {"preemption_mode": "swap", "swap_space_blocks": 64} if mode == "swap" else {}
    llm = LLM(model, **{**CONFIG, "num_blocks": 20, "watermark_blocks": 0}, **swap)  # 19 blocks
    engine = llm.engine
    compiled = engine.num_compilations
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 250, n)] for i, n in enumerate((40, 12, 40, 12))]
    reqs = [engine.add_prompt_ids(str(i), p, greedy(30))[0] for i, p in enumerate(prompts)]
    swapped = 0
    while engine.has_unfinished_requests():
        engine.step()
        swapped += len(engine.scheduler.swapped)
    assert [r.output_token_ids for r in reqs] == one_by_one(whole, prompts, 30)
    assert engine.scheduler.num_preemptions > 0 and (swapped > 0) == (mode == "swap")
    assert engine.num_compilations == compiled
    assert_kv_all_free(engine)
