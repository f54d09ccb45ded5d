"""N-gram speculative decoding on the device: verification keeps greedy output token for token
(alone, batched, async or not, with penalties, stop rules, logprobs and prefix hits on its own
output), sampled output keeps its distribution (the verify rule against the exact distribution,
and the engine with and without speculation), the KV pool ends free, and warm-up compiles every
verify program (tiny random model, small buckets)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_stats import assert_distributed_as, assert_same_distribution, seeded_first_tokens

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.sampler import sampling_logits
from jaxserve.sampling_tensors import PenaltyCounts, RowSampling, SamplingTensors
from jaxserve.speculative import propose_ngram
from jaxserve.speculative.verify import verify

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
# Speculation while at most 4 requests run: 8 running requests decode without it.
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 4,
    "adaptive_draft_length": False,  # every step drafts k (the adaptive choice: test_speculative_adaptive)
}


# ----- the verify rule against the exact distribution -------------------------------------------

V = 40
_verify = jax.jit(verify, static_argnames="num_top_logprobs")


def _rows(params: SamplingParams, n: int, slot: int = -1) -> SamplingTensors:
    """n sequences of one draft: rows 2i (tests the draft) and 2i + 1 (the bonus), seed i."""
    rows = [RowSampling(params, seed=i, position=10 + j, penalty_row=slot) for i in range(n) for j in range(2)]
    return SamplingTensors.build(rows, 2 * n, spare_row=1)


def test_sampled_verification_keeps_the_processed_distribution():
    n, draft = 6000, 3
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (2, V)).astype(np.float32)
    logits[0, draft] += 1.0  # a likely draft: accepted about half the time
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9)
    t = _rows(params, n)
    tiled = np.tile(logits, (n, 1))
    drafts = np.tile(np.array([draft, -1], np.int32), n)
    history = np.tile(np.array([[-1], [draft]], np.int32), (n, 1))
    out, _ = _verify(tiled, t, PenaltyCounts.zeros(1, V), drafts, history, num_top_logprobs=0)
    tokens = np.asarray(out.tokens)
    probs = np.asarray(jax.nn.softmax(sampling_logits(jnp.asarray(logits), _rows(params, 1)), axis=-1))

    assert_distributed_as(tokens[:, 0], probs[0])
    accepted = tokens[:, 0] == draft
    assert abs(accepted.mean() - probs[0, draft]) < 4 * math.sqrt(probs[0, draft] / n)
    assert (tokens[~accepted, 1] == -1).all()  # a rejection ends the sequence's tokens
    assert_distributed_as(tokens[accepted, 1], probs[1])  # the bonus token after an accepted draft


def test_greedy_verification_counts_the_drafts_in_the_penalties_of_the_rows_after_them():
    draft, second = 5, 9
    logits = np.zeros((2, V), np.float32)
    logits[0, draft] = 3.0  # row 0's argmax is the draft: accepted
    logits[1, draft], logits[1, second] = 2.0, 1.5  # row 1 would repeat it without its penalty
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    t = SamplingTensors.build([RowSampling(params, 0, 10 + j, penalty_row=0) for j in range(2)], 2, spare_row=1)
    drafts = np.array([draft, -1], np.int32)
    history = np.array([[-1], [draft]], np.int32)
    out, counts = _verify(logits, t, PenaltyCounts.zeros(1, V), drafts, history, num_top_logprobs=0)
    assert np.asarray(out.tokens).tolist() == [[draft, second]]
    output = np.asarray(counts.output)
    assert output[0, draft] == 1 and output[0, second] == 1 and output[0].sum() == 2  # the emitted tokens
    assert output[1].sum() == 0  # the spare slot stays zero


# ----- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return build_tiny_random()


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, warm_up=False, **SMALL)


@pytest.fixture(scope="module")
def speculative(model):
    return LLM(model, speculative_config=SPEC, **SMALL)  # warmed up: see the last test


def repetitive_prompts(n: int, seed: int) -> list[dict]:
    """Prompts that repeat a random span, so that n-grams recur from the first decode on."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        span = rng.integers(3, 250, int(rng.integers(4, 12))).tolist()
        prompts.append({"prompt_token_ids": span * 3 + span[:2]})
    return prompts


GREEDY = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(
        max_tokens=19,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    ),
    SamplingParams(max_tokens=22, temperature=0.0, min_tokens=9, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[40, 41, 42, 43, 44, 45, 46, 47]),
    SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
]


def outputs(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]


def logprobs(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs if o.outputs[0].logprobs is not None]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_output_is_token_for_token_the_same_batched_and_alone(
    plain, model, async_scheduling, assert_kv_all_free
):
    prompts = repetitive_prompts(10, seed=1)
    # Two long requests outlast the rest, so the batch surely falls below the threshold and
    # speculates for many steps, whatever order the scheduler packs the prompts in.
    params = [GREEDY[i % len(GREEDY)] for i in range(len(prompts) - 2)]
    params += [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 2
    expected = outputs(plain, prompts, params)
    llm = LLM(model, warm_up=False, async_scheduling=async_scheduling, speculative_config=SPEC, **SMALL)
    assert outputs(llm, prompts, params) == expected  # 10 requests: batches above and below the threshold
    stats = llm.engine.stats
    assert stats.speculative_steps > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    for i in (0, 1, 2):
        assert outputs(llm, prompts[i : i + 1], params[i : i + 1]) == expected[i : i + 1]
    assert_kv_all_free(llm.engine)


def test_logprobs_of_accepted_tokens_and_prefix_hits_on_verified_output(plain, speculative, assert_kv_all_free):
    prompts = repetitive_prompts(4, seed=2)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1)] * 4
    first = speculative.generate(prompts, params, use_tqdm=False)
    np.testing.assert_allclose(
        sum(logprobs(speculative, prompts, params), []), sum(logprobs(plain, prompts, params), []), atol=1e-4
    )
    # Continue each from the middle of its own output: the blocks it hits in the prefix cache
    # were written by verify steps, and must hold only accepted tokens.
    cont = [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids[:17]} for p, o in zip(prompts, first)]
    hits_before = speculative.engine.kv.stats.hit_tokens
    again = outputs(speculative, cont, [SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)] * 4)
    assert speculative.engine.kv.stats.hit_tokens - hits_before >= 4 * 32
    assert [a[0] for a in again] == [o.outputs[0].token_ids[17:] for o in first]
    assert_kv_all_free(speculative.engine)


def test_seeded_sampling_keeps_its_distribution(plain, speculative, assert_kv_all_free):
    """The first three tokens of 320 seeded requests (top-k 2: eight outcomes; the second and third
    come from one verify step of one draft), with and without speculation: a two-sample
    chi-square test, and speculation did accept and reject drafts."""
    # The prompt: a start and the model's own greedy continuation up to a point where, after the
    # likeliest next token, the n-gram draft is the greedy token after it (the continuation repeats
    # itself there), so that drafts are likely, neither certain nor impossible.
    start = repetitive_prompts(1, seed=3)[0]["prompt_token_ids"]
    greedy = outputs(
        plain, [{"prompt_token_ids": start}], [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]
    )[0][0]
    cut = next(
        i for i in range(1, len(greedy) - 1) if propose_ngram(start + greedy[: i + 1], 1, 1, 3) == [greedy[i + 1]]
    )
    prompt = {"prompt_token_ids": start + greedy[:cut]}
    n = 320

    before = dataclasses.replace(speculative.engine.stats)
    with_spec, without = (
        seeded_first_tokens(speculative, prompt, n, 2, 0),
        seeded_first_tokens(plain, prompt, n, 2, 10_000),
    )
    drafted = speculative.engine.stats.draft_tokens - before.draft_tokens
    accepted = speculative.engine.stats.accepted_tokens - before.accepted_tokens
    assert 0 < accepted < drafted
    assert_same_distribution(with_spec, without)
    assert_kv_all_free(speculative.engine)


def test_no_compilation_after_warm_up_with_speculation(plain, speculative):
    assert plain.engine.runner.inputs.verify_batches == ()  # no verify programs without speculation
    compiled = speculative.engine.num_compilations
    assert {key for key in speculative.engine.runner.executables.compiled if key[0].startswith("verify")} == {
        ("verify", 2, 16),
        ("verify", 8, 16),
        ("verify_sample", 8),
        ("verify_sample", 32),
    }
    prompts = repetitive_prompts(9, seed=4)
    params = [GREEDY[i % len(GREEDY)] for i in range(9)]
    params[3] = SamplingParams(max_tokens=15, temperature=0.9, top_p=0.8, seed=2, presence_penalty=0.5)
    speculative.generate(prompts, params, use_tqdm=False)
    speculative.generate(prompts[:1], params[:1], use_tqdm=False)  # a verify batch of one
    assert speculative.engine.num_compilations == compiled
