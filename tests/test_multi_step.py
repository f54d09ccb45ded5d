"""Multi-step decode (`num_scheduler_steps`): K decode steps in one device loop give the same
tokens, log-probabilities and finish reasons as one step at a time (greedy and seeded, with
penalties, min_tokens, stop tokens and strings, length limits, preemption, async or not), stop
rows on the device, take about 1/K of the iterations, compile nothing after warm-up, and leave
the KV pool free (tiny random model, small buckets)."""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams

SMALL = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=200,
    decode_batch_buckets=(2, 8),
    block_table_buckets=(16,),
    sampler_row_buckets=(8,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
)

PARAMS = [
    SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True),
    SamplingParams(
        max_tokens=19,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    ),
    SamplingParams(max_tokens=22, temperature=0.0, min_tokens=9, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[40, 41, 42, 43, 44, 45, 46, 47, 48, 49]),
    SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=21, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=18, temperature=1.1, top_k=20, seed=5, frequency_penalty=0.5, ignore_eos=True),
]


@pytest.fixture(scope="module")
def model():
    return build_tiny_random()


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, warm_up=False, **SMALL)


def prompts(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 250, int(rng.integers(3, 30))).tolist()} for _ in range(n)]


def outputs(llm: LLM, prompt_list: list[dict], params: list[SamplingParams]) -> list:
    outs = llm.generate(prompt_list, params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            o.outputs[0].text,
            None if o.outputs[0].logprobs is None else [round(lp.logprob, 4) for lp in o.outputs[0].logprobs],
        )
        for o in outs
    ]


@pytest.mark.parametrize("steps, async_scheduling", [(4, True), (3, False)])
def test_outputs_are_the_same_as_one_step_at_a_time(plain, model, steps, async_scheduling, assert_kv_all_free):
    batch = prompts(10, seed=1)
    params = [PARAMS[i % len(PARAMS)] for i in range(len(batch))]
    expected = outputs(plain, batch, params)
    assert any(reason == "stop" for _, reason, _, _ in expected)  # a stop token inside some loop
    llm = LLM(model, warm_up=False, num_scheduler_steps=steps, async_scheduling=async_scheduling, **SMALL)
    assert outputs(llm, batch, params) == expected
    for i in (0, 5):  # alone: every iteration after the first prompt's is a loop
        assert outputs(llm, batch[i : i + 1], params[i : i + 1]) == expected[i : i + 1]
    assert_kv_all_free(llm.engine)


def test_stop_strings_and_the_context_end_inside_a_loop(plain, model, assert_kv_all_free):
    prompt = prompts(1, seed=3)[0]
    free_run = (
        plain.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    stop = free_run[len(free_run) // 2 : len(free_run) // 2 + 3]
    long_prompt = {
        "prompt_token_ids": prompt["prompt_token_ids"] * 2
        + list(range(3, 3 + 128 - 6 - 2 * len(prompt["prompt_token_ids"])))
    }
    batch = [prompt, long_prompt]
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    ]  # ends at max_model_len
    expected = outputs(plain, batch, params)
    assert expected[0][1] == "stop" and expected[1][1] == "length" and len(expected[1][0]) == 6
    llm = LLM(model, warm_up=False, num_scheduler_steps=4, **SMALL)
    assert outputs(llm, batch, params) == expected
    assert_kv_all_free(llm.engine)


def test_a_stop_token_ends_the_row_on_the_device_and_loops_cut_the_iterations(plain, model, assert_kv_all_free):
    prompt = prompts(1, seed=7)
    free_run = (
        plain.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    # The prefill samples token 0, then loops of 4 sample 1-4, 5-8, ...: a stop token first
    # sampled inside a loop, not at its end.
    at = next(i for i in range(6, 24) if free_run[i] not in free_run[:i] and i % 4 != 0)
    stop = free_run[at]
    llm = LLM(model, warm_up=False, num_scheduler_steps=4, **SMALL)
    read = []  # how many tokens each multi-step row came back with, before the host's stop rules
    fetch = llm.engine.runner.fetch

    def recording_fetch(handle):
        results = fetch(handle)
        read.extend(len(tokens) for chunk, tokens in results if chunk.num_steps > 1)
        return results

    llm.engine.runner.fetch = recording_fetch
    out = llm.generate(
        prompt, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop], ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == free_run[: at + 1] and out.finish_reason == "stop"
    assert read == [4] * ((at - 1) // 4) + [(at - 1) % 4 + 1]  # the device sent nothing after the stop
    # 24 tokens: one prefill iteration, then loops of 4 (23 tokens in 6 loops).
    steps_before = llm.engine.stats.num_steps
    llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.stats.num_steps - steps_before == 1 + 6
    assert_kv_all_free(llm.engine)


def test_preemption_under_multi_step_decode_keeps_the_outputs(plain, model, assert_kv_all_free):
    batch = prompts(8, seed=4)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 4 + [
        SamplingParams(max_tokens=36, temperature=0.8, seed=i, ignore_eos=True) for i in range(4)
    ]
    expected = outputs(plain, batch, params)
    tight = {**SMALL, "num_blocks": 40}  # 8 requests of up to ~70 tokens need ~60 blocks of 8
    llm = LLM(model, warm_up=False, num_scheduler_steps=4, **tight)
    assert outputs(llm, batch, params) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_kv_all_free(llm.engine)


def test_no_compilation_after_warm_up_with_multi_step_decode(model):
    llm = LLM(model, num_scheduler_steps=4, **SMALL)
    assert {key for key in llm.engine.runner.executables.compiled if key[0] == "multi_decode"} == {
        ("multi_decode", 2, 16),
        ("multi_decode", 8, 16),
    }
    compiled = llm.engine.num_compilations
    batch = prompts(6, seed=9)
    llm.generate(batch, [PARAMS[i] for i in range(6)], use_tqdm=False)
    llm.generate(batch[:1], PARAMS[:1], use_tqdm=False)
    assert llm.engine.num_compilations == compiled


def test_num_scheduler_steps_must_be_a_positive_integer(model):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(model, warm_up=False, num_scheduler_steps=0, **SMALL)
