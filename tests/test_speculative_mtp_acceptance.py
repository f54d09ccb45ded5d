"""MTP speculative decoding with one draft token (k = 1): greedy output the same as without it on a tiny random
DeepSeek-V3 (the synchronous loop; preemptions), and an MTP layer whose drafts are known
(`mtp_models.successor_model`) accepted as predicted: every draft (it reads the target's hidden state right)."""

from __future__ import annotations

import pytest
from mtp_models import ENGINE, PROMPTS, mtp, outputs, params_for, successor_model, tiny_deepseek_with_mtp

from jaxserve import LLM, SamplingParams

K = 1


@pytest.fixture(scope="module")
def model():
    return tiny_deepseek_with_mtp()


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, warm_up=False, **ENGINE)


def test_one_draft_token_in_the_synchronous_loop_keeps_greedy_output(model, plain, assert_kv_all_free):
    llm = LLM(model, warm_up=False, async_scheduling=False, speculative_config=mtp(K), **ENGINE)
    assert outputs(llm, PROMPTS, params_for(PROMPTS)) == outputs(plain, PROMPTS, params_for(PROMPTS))
    assert llm.engine.stats.draft_tokens > 0
    assert_kv_all_free(llm.engine)


def test_preemption_frees_the_mtp_kv_and_greedy_output_stays(model, plain, assert_kv_all_free):
    """A pool too small for the four requests preempts some (their MTP blocks and hidden states dropped, the
    target's recomputed rows handed over again when they return): the same tokens."""
    prompts = PROMPTS[1:5]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(model, warm_up=False, speculative_config=mtp(K), **{**ENGINE, "num_blocks": 24})
    assert outputs(llm, prompts, params) == outputs(plain, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats.draft_tokens > 0
    assert_kv_all_free(llm.engine)
    assert not llm.engine.proposer.hidden


def test_states_waiting_while_the_batch_is_too_large_to_draft_for_are_caught_up(model, plain, assert_kv_all_free):
    """Three requests and `disable_by_batch_size` 1: no drafts while two or more run, yet no request's waiting
    hidden states grow past a token bucket (64) and a prefill chunk (64); drafting starts when one is left."""
    llm = LLM(model, warm_up=False, speculative_config=mtp(K, disable_by_batch_size=1), **ENGINE)
    proposer, most = llm.engine.proposer, [0]
    take_hidden = proposer.take_hidden

    def watched(rows):
        take_hidden(rows)
        most[0] = max([most[0], *(p.num_rows for p in proposer.hidden.values())])

    proposer.take_hidden = watched
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (70, 40, 100)]
    assert outputs(llm, PROMPTS[:3], params) == outputs(plain, PROMPTS[:3], params)
    assert 0 < most[0] < 128 and llm.engine.stats.draft_tokens > 0
    assert_kv_all_free(llm.engine)


def test_an_mtp_layer_that_predicts_the_next_token_has_every_draft_accepted(model, assert_kv_all_free):
    """The successor model (`mtp_models.successor_model`): its target emits t + 1 after t, and its MTP layer
    drafts t_{i+2} from the target's h_i, always right (the overlapped loop, two requests, one prompt longer
    than a prefill chunk)."""
    successor = successor_model(model)
    llm = LLM(successor, warm_up=False, speculative_config=mtp(K), **ENGINE)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(20, 100))}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert outputs(llm, prompts, params) == [list(range(8, 20)), list(range(100, 112))]
    stats = llm.engine.stats
    assert stats.num_drafts > 4 and stats.accepted_tokens == stats.num_drafts
    assert stats.position_accepted == stats.position_drafts == [stats.num_drafts]
    assert_kv_all_free(llm.engine)
