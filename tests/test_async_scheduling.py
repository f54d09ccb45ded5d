"""Async scheduling (iteration N+1 launched before N's tokens are read) against the synchronous
loop: the same tokens for greedy, seeded, penalised (their counts live on the device) and stopped
requests, under chunked prefill, prefix hits and both kinds of preemption; and proof, from the runner's
launch counter, that
reads really come after the next launch."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.request import PLACEHOLDER, Request, RequestStatus
from jaxserve.runner.prepared_step import PreparedStep
from jaxserve.scheduler.output import SchedulerOutput

SMALL = dict(
    max_num_seqs=16,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=8,
    decode_batch_buckets=(4, 16),
    block_table_buckets=(32,),
    sampler_row_buckets=(16,),
    prefill_token_buckets=(32, 64),
    prefill_seq_buckets=(1, 4),
)


@pytest.fixture(scope="module")
def model():
    return build_tiny_random()


def make_llm(model, async_scheduling: bool, **overrides) -> LLM:
    return LLM(model, warm_up=False, async_scheduling=async_scheduling, **{**SMALL, **overrides})


def prompts(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 250, 24).tolist()  # a common prefix: prefix-cache hits
    return [
        {"prompt_token_ids": (shared if i % 2 else []) + rng.integers(3, 250, int(rng.integers(1, 90))).tolist()}
        for i in range(n)
    ]


def mixed_params(n: int) -> list[SamplingParams]:
    kinds = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.9, top_p=0.8, seed=11),
        SamplingParams(max_tokens=9, temperature=1.0, top_k=5, seed=5, n=2),
        SamplingParams(max_tokens=15, temperature=0.0, min_tokens=6, logprobs=2),
        SamplingParams(max_tokens=16, temperature=0.7, seed=3, stop_token_ids=[40, 41, 42, 43, 44]),
        SamplingParams(
            max_tokens=18,
            temperature=0.0,
            ignore_eos=True,
            repetition_penalty=1.4,
            frequency_penalty=0.3,
            presence_penalty=0.2,
        ),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def run(llm: LLM, ps: list[dict], params: list[SamplingParams]) -> list:
    outs = llm.generate(ps, params, use_tqdm=False)
    return [[(o.token_ids, o.finish_reason, o.text) for o in out.outputs] for out in outs]


@pytest.mark.parametrize("case", ["roomy", "recompute", "swap"])
def test_async_and_sync_loops_give_the_same_outputs(model, case, assert_kv_all_free):
    pool = {
        "roomy": dict(num_blocks=400),
        "recompute": dict(num_blocks=40),
        "swap": dict(num_blocks=40, preemption_mode="swap", swap_space_blocks=200),
    }[case]
    ps, params = prompts(24, seed=1), mixed_params(24)
    results = {}
    for flag in (False, True):
        llm = make_llm(model, flag, **pool)
        results[flag] = run(llm, ps, params)
        # the same prompts again: their blocks are prefix-cache hits now
        assert run(llm, ps, params) == results[flag]
        if case != "roomy":
            assert llm.engine.scheduler.num_preemptions > 0
        assert_kv_all_free(llm.engine)
    assert results[True] == results[False]


def test_penalties_and_stop_strings_are_equal_too(model):
    ps = prompts(6, seed=2)
    params = [
        SamplingParams(
            max_tokens=24, temperature=0.8, seed=i, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2
        )
        for i in range(3)
    ]
    sync = make_llm(model, False, num_blocks=400)
    text = (
        sync.generate(ps[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params += [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])] * 3
    on = make_llm(model, True, num_blocks=400)
    assert run(on, ps, params) == run(sync, ps, params)


def test_the_next_iteration_is_launched_before_the_previous_is_read(model):
    on = make_llm(model, True, num_blocks=400)
    off = make_llm(model, False, num_blocks=400)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for llm in (on, off):
        llm.generate(prompts(4, seed=3), params, use_tqdm=False)
    steps = on.engine.stats.num_steps
    # Every read but the last one's (nothing left to launch then) followed the next launch.
    assert on.engine.stats.overlapped_reads >= steps - 2 > 0
    assert off.engine.stats.overlapped_reads == 0


def test_a_penalty_row_set_while_its_last_token_is_in_flight_counts_that_token(model):
    """A request that gets its penalty row while the token it consumes is still a placeholder
    (readmitted in the iteration after the one sampling it) counts that token from the device."""
    runner = make_llm(model, True, num_blocks=400).engine.runner
    req = Request("p", [5, 6, 7], SamplingParams(max_tokens=4, frequency_penalty=1.0), seed=0)
    req.status = RequestStatus.RUNNING
    req.output_token_ids = [9]
    last = jax.device_put(np.arange(runner.inputs.sampled_rows, dtype=np.int32) + 20)  # row r: 20 + r
    runner.state = runner.state.with_sampler(dataclasses.replace(runner.state.sampler, sampled=last))
    batch = runner.inputs.batch
    batch.join(req)
    batch.launched(1, [(np.array([batch.row_of(req)]), 3)])  # the launch sampling its next token, at row 3
    req.output_token_ids.append(PLACEHOLDER)
    runner.run_model(SchedulerOutput(), PreparedStep([runner.inputs.penalty_reset([req])], [req], [], []))
    counts = np.asarray(runner.state.sampler.penalty_counts.output)[runner.inputs.batch.row_of(req)]
    assert counts[9] == 1 and counts[23] == 1 and counts.sum() == 2


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_generated_blocks_join_the_prefix_cache_once_their_tokens_are_read(model, async_scheduling):
    """After every step, each running request's full blocks whose tokens are all computed and
    known (read from the device, none in flight) are in the prefix cache: with overlap, a
    block whose last token was in flight at its launch is cached when that token is read."""
    engine = make_llm(model, async_scheduling, num_blocks=400).engine
    bs = engine.config.block_size
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(6, seed=4)):
        engine.add_request(f"r{i}", p["prompt_token_ids"], params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            full = min(req.num_computed_tokens, req.num_known_tokens) // bs
            assert req.kv.cached_blocks == full, (req.request_id, req.num_computed_tokens)
            checked += full > len(req.prompt_token_ids) // bs  # a block of generated tokens
    assert checked > 0
