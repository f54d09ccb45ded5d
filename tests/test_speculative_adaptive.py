"""The adaptive draft length in the engine (tiny random target, drafts loaded from disk): greedy output token for
token the same as without drafts whatever draft length is chosen (pinned at each k, and adaptive), no draft
longer than the k chosen, no compilation after warm-up, every KV block free after; and with a draft whose tokens
are almost never accepted, the engine stops drafting (and /metrics' mean draft length shows it)."""

from __future__ import annotations

import numpy as np
import pytest
from draft_models import write_drafts

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.speculative.draft_length import DraftLength, bucket_of

SMALL = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=160,
    block_size=8,
    num_blocks=200,
    decode_batch_buckets=(2, 4),
    block_table_buckets=(32,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(32, 64),
    prefill_seq_buckets=(4,),
)
K = 3


@pytest.fixture(scope="module")
def target():
    return build_tiny_random()


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    """A noisy copy of the target (drafts often accepted) and a random one-layer model (almost never)."""
    return write_drafts(target, tmp_path_factory.mktemp("drafts"))


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, warm_up=False, **SMALL)


def speculative(target, draft: str) -> LLM:
    spec = {"model": draft, "num_speculative_tokens": K, "disable_by_batch_size": 4}
    return LLM(target, speculative_config=spec, **SMALL)  # warmed up


def prompts(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 250, int(rng.integers(5, 60))).tolist()} for _ in range(n)]


def greedy(llm: LLM, batch: list[dict], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def test_greedy_output_is_the_same_whatever_draft_length_is_chosen(plain, target, drafts, assert_kv_all_free):
    llm = speculative(target, drafts["noisy"])
    engine, compiled = llm.engine, llm.engine.num_compilations
    batch = prompts(4, seed=1)
    expected = greedy(plain, batch, 40)
    for k in (1, 2, K, None):  # pinned at each k, then adaptive
        engine.proposer.draft_length = DraftLength(K) if k is None else DraftLength(k, adaptive=False)
        before = engine.snapshot()
        assert greedy(llm, batch, 40) == expected
        assert greedy(llm, batch[:1], 40) == expected[:1]
        after = engine.snapshot()
        drafted = [b - a for a, b in zip(before.position_drafts, after.position_drafts)]
        accepted = after.accepted_tokens - before.accepted_tokens
        if k is not None:  # every draft at most k long, and some k long
            assert drafted[k - 1] > 0 and not any(drafted[k:]) and accepted > 0
            chosen = after.chosen_draft_tokens - before.chosen_draft_tokens
            assert chosen == k * (after.draft_length_steps - before.draft_length_steps)
    assert engine.num_compilations == compiled
    assert_kv_all_free(engine)


def test_the_engine_stops_drafting_where_drafts_are_not_accepted(plain, target, drafts, assert_kv_all_free):
    llm = speculative(target, drafts["small"])
    engine = llm.engine
    batch = prompts(2, seed=2)
    expected = greedy(plain, batch, 120)
    before = engine.snapshot()
    assert greedy(llm, batch, 120) == expected
    after = engine.snapshot()
    length = engine.proposer.draft_length
    costs = length.buckets[bucket_of(2)]
    assert length.best(costs) == 0  # measured: a plain step gives more tokens per second
    # Drafting off after measuring, but for probes: most of the ~120 decode steps ran without drafts.
    steps = after.draft_length_steps - before.draft_length_steps
    assert steps >= 100 and after.speculative_steps - before.speculative_steps < steps / 4
    assert after.mean_draft_length < K / 4
    assert_kv_all_free(engine)
