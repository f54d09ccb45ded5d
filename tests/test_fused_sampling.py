"""A decode step samples inside its own program (one compiled call), unless it has constrained
rows: then the sampler's program samples its logits once their masks are written. Prefill
steps always use the sampler's program. Either way a row gets the same tokens."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.structured import GuidedDecoding

SMALL = dict(
    max_num_seqs=16,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=8,
    num_blocks=256,
    decode_batch_buckets=(4, 16),
    block_table_buckets=(32,),
    sampler_row_buckets=(16,),
    prefill_token_buckets=(32, 64),
    prefill_seq_buckets=(1, 4),
)

# Greedy, seeded top-p, top-k with n = 2, min_tokens with logprobs, stop ids, penalties.
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=17, temperature=0.9, top_p=0.8, seed=11, logprobs=3),
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
# A constrained neighbour that runs in every iteration of the others: their steps all sample apart.
CONSTRAINED = SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedDecoding("regex", "[a-z]{200}"))


def counted_calls(llm: LLM) -> collections.Counter:
    """Calls of each kind of compiled program (by the first item of its key) from now on."""
    calls = collections.Counter()
    executables = llm.engine.runner.executables.compiled

    def counting(key, exe):
        def call(*args):
            calls[key[0]] += 1
            return exe(*args)

        return call

    for key, exe in list(executables.items()):
        executables[key] = counting(key, exe)
    return calls


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_rows_sample_the_same_in_the_step_and_in_the_sampler_program(async_scheduling, assert_kv_all_free):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 250, int(rng.integers(4, 40))).tolist() for _ in PARAMS]
    llm = LLM(build_tiny_random(), async_scheduling=async_scheduling, **SMALL)
    calls = counted_calls(llm)

    fused = run(llm, prompts, PARAMS)
    assert calls["sample"] == calls["prefill"] > 0  # decode steps sampled in their own program
    assert calls["decode"] + calls["prefill"] == llm.engine.stats.num_steps and calls["decode"] > 10
    assert_kv_all_free(llm.engine)

    calls.clear()
    with_constrained = run(llm, [[5, 6, 7]] + prompts, [CONSTRAINED] + PARAMS)
    assert calls["sample"] == calls["decode"] + calls["prefill"]  # the decode steps left sampling to it too
    assert len(with_constrained[0][0][0]) == 40 and with_constrained[0][0][1] == "length"
    for got, want in zip(with_constrained[1:], fused):
        assert [(t, f) for t, f, _ in got] == [(t, f) for t, f, _ in want]
        for (*_, got_lp), (*_, want_lp) in zip(got, want):
            assert (got_lp is None) == (want_lp is None)
            for g, w in zip(got_lp or [], want_lp or []):
                assert (g.token_id, [t for t, _ in g.top]) == (w.token_id, [t for t, _ in w.top])
                assert g.logprob == pytest.approx(w.logprob, rel=1e-5, abs=1e-6)
    assert_kv_all_free(llm.engine)
