"""MTP speculative decoding (a tiny random DeepSeek-V3 with a multi-token prediction layer, f32; k = 1 and exact
acceptance: tests/test_speculative_mtp_acceptance.py): greedy output token for token the same as without it
(k = 3, batched and alone, prompts longer than a prefill chunk, prefix-cache hits), the proposer's drafts equal
to a reference of the MTP formula on the hidden states the target computed, sampled output that keeps its
distribution, no compilation after warm-up, the MTP's KV freed, and the targets and settings refused."""

from __future__ import annotations

import numpy as np
import pytest
from mtp_models import ENGINE, PROMPTS, mtp, outputs, params_for, tiny_deepseek_with_mtp
from mtp_reference import reference_chain
from sampling_stats import assert_same_distribution, seeded_first_tokens

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.config_resolution import resolve
from jaxserve.speculative.config import SpeculativeConfig


@pytest.fixture(scope="module")
def model():
    return tiny_deepseek_with_mtp()


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, warm_up=False, **ENGINE)


@pytest.fixture(scope="module")
def speculative(model):
    return LLM(model, speculative_config=mtp(3), **ENGINE)  # warmed up: no compilation after


def test_greedy_output_is_the_same_with_mtp_batched_alone_and_after_prefix_hits(plain, speculative, assert_kv_all_free):
    """Six requests (two prompts longer than the 64-token prefill chunk), then one alone, then prompts whose
    blocks the prefix cache holds (their MTP positions before the hit are caught up without hidden states):
    the same tokens as without MTP, and nothing compiled after warm-up."""
    engine = speculative.engine
    compiled = engine.num_compilations
    expected = outputs(plain, PROMPTS, params_for(PROMPTS))
    assert outputs(speculative, PROMPTS, params_for(PROMPTS)) == expected
    assert outputs(speculative, PROMPTS[:1], params_for(PROMPTS[:1])) == expected[:1]
    cached = engine.kv.stats.hit_tokens
    assert outputs(speculative, PROMPTS[3:5], params_for(PROMPTS[:2])) == outputs(
        plain, PROMPTS[3:5], params_for(PROMPTS[:2])
    )
    assert engine.kv.stats.hit_tokens > cached
    stats = engine.stats
    assert stats.speculative_steps > 0 and stats.draft_tokens > 0
    assert engine.num_compilations == compiled
    assert_kv_all_free(engine)
    assert not engine.proposer.hidden


# ----- the drafts against the MTP formula -------------------------------------------------------------


def test_drafts_are_the_mtp_formula_on_the_targets_hidden_states(speculative, assert_kv_all_free):
    """Every draft of a greedy request (k = 3, its prompt caught up in two chunks) equals `reference_chain` on
    the hidden states the engine handed the proposer."""
    engine, proposer = speculative.engine, speculative.engine.proposer
    seen: dict[int, np.ndarray] = {}  # position -> the target's hidden state there
    proposals = []
    take_hidden, propose = proposer.take_hidden, proposer.propose

    def record_hidden(rows):
        for r in rows:
            for i, row in enumerate(r.rows):
                seen[r.position + i] = row
        take_hidden(rows)

    def record_proposals(decodes, num_running):
        drafts = propose(decodes, num_running)
        for req, draft in (drafts or {}).items():
            proposals.append((req.copy_tokens(), draft))
        return drafts

    proposer.take_hidden, proposer.propose = record_hidden, record_proposals
    try:
        prompt = {"prompt_token_ids": np.random.default_rng(7).integers(3, 299, 80).tolist()}  # no prefix hit
        outputs(speculative, [prompt], [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)])
    finally:
        del proposer.take_hidden, proposer.propose
    assert len(proposals) > 3
    for tokens, draft in proposals:
        hidden = np.stack([seen[i] for i in range(len(tokens) - 1)])
        assert draft == reference_chain(proposer.device.model, proposer.device.params, hidden, tokens, len(draft))
    assert_kv_all_free(engine)


def test_seeded_sampling_keeps_its_distribution(model, plain, speculative, assert_kv_all_free):
    """The first three tokens of 160 seeded requests at temperature 1 (top-k 3), with and without MTP drafts
    (drawn from the MTP layer's q, verified by rejection sampling): a two-sample chi-square test."""
    prompt = PROMPTS[4]
    stats = speculative.engine.stats
    drafted = stats.draft_tokens
    with_mtp = seeded_first_tokens(speculative, prompt, 160, 3, 0)
    assert stats.draft_tokens > drafted
    assert_same_distribution(with_mtp, seeded_first_tokens(plain, prompt, 160, 3, 10_000))
    assert_kv_all_free(speculative.engine)


# ----- what is refused ----------------------------------------------------------------------------------


def test_vllms_name_is_read_and_mtp_takes_no_model():
    assert SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 2}).method == "mtp"
    with pytest.raises(ValueError, match="speculative method 'mtp' takes no model"):
        SpeculativeConfig.parse({"method": "mtp", "model": "x", "num_speculative_tokens": 2})


@pytest.mark.parametrize(
    "setting, named",
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"expert_parallel_size": 2}, "expert_parallel_size=2"),
        ({"quantization": "int8"}, "quantization=int8"),
        ({"num_scheduler_steps": 4}, "num_scheduler_steps=4"),
    ],
)
def test_settings_mtp_is_not_served_with_are_refused_by_name(model, setting, named):
    config = EngineConfig(speculative_config=SpeculativeConfig("mtp", 2), **setting)
    with pytest.raises(ValueError, match=f'speculative method "mtp" is not served with {named}'):
        resolve(config, model.config)


def test_a_target_without_an_mtp_layer_is_refused():
    spec = mtp(2)
    with pytest.raises(ValueError, match=r"has none \(num_nextn_predict_layers = 0\)"):
        LLM(build_tiny_random(family="deepseek_v3"), warm_up=False, speculative_config=spec, **ENGINE)
    with pytest.raises(ValueError, match="this model is llama"):
        LLM(build_tiny_random(), warm_up=False, speculative_config=spec, **ENGINE)
