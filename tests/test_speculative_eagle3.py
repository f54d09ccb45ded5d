"""EAGLE-3 speculative decoding (`"method": "eagle3"`) on the tiny random Llama (2 layers, f32) with a random head
written at test time in vLLM's layout (`eagle3_heads`: aux layers [0, 1, 1], a draft vocabulary of half the
target's, d2t / t2d): greedy output token for token the same as without it (k = 3, batched and alone, prompts
longer than a prefill chunk, prefix-cache hits), the aux states handed to the head and its drafts against a
numpy reference (`eagle3_reference`), seeded sampling that keeps
its distribution, no compilation after warm-up, both KV pools freed; a head built to predict the target
(`eagle3_heads.successor_head`) accepted as predicted. The loader's tests: tests/test_speculative_eagle3_loading.py."""

from __future__ import annotations

import numpy as np
import pytest
from eagle3_heads import random_head, successor_head
from eagle3_reference import reference_chain
from mtp_models import ENGINE, PROMPTS, outputs, params_for, successor_target
from sampling_stats import assert_same_distribution, seeded_first_tokens

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams


def eagle3(head: str, k: int) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "adaptive_draft_length": False}


@pytest.fixture(scope="module")
def model():
    return build_tiny_random()


@pytest.fixture(scope="module")
def head(model, tmp_path_factory):
    return random_head(tmp_path_factory.mktemp("eagle3") / "head", model.config)


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, warm_up=False, **ENGINE)


@pytest.fixture(scope="module")
def speculative(model, head):
    return LLM(model, speculative_config=eagle3(head, 3), **ENGINE)  # warmed up: no compilation after


def test_greedy_output_is_the_same_with_eagle3_batched_alone_and_after_prefix_hits(
    plain, speculative, assert_kv_all_free
):
    engine = speculative.engine
    compiled = engine.num_compilations
    expected = outputs(plain, PROMPTS, params_for(PROMPTS))
    assert outputs(speculative, PROMPTS, params_for(PROMPTS)) == expected
    assert outputs(speculative, PROMPTS[:1], params_for(PROMPTS[:1])) == expected[:1]
    cached = engine.kv.stats.hit_tokens
    prompts = PROMPTS[3:5]
    assert outputs(speculative, prompts, params_for(prompts)) == outputs(plain, prompts, params_for(prompts))
    assert engine.kv.stats.hit_tokens > cached
    stats = engine.stats
    assert stats.speculative_steps > 0 and stats.draft_tokens > 0
    assert engine.num_compilations == compiled
    assert_kv_all_free(engine)
    assert not engine.proposer.hidden


def test_the_head_gets_the_aux_streams_and_drafts_as_the_reference(model, speculative, assert_kv_all_free):
    """Aux layers [0, 1, 1]: each row handed over is [e(t) | x_1 | x_1], the embedding of the row's token (the
    stream entering layer 0) and twice the stream entering layer 1 (layer 0 added to it); every greedy draft
    (k = 3, an 80-token prompt caught up in two chunks) equals `eagle3_reference` on those rows."""
    proposer, seen, proposals = speculative.engine.proposer, {}, []
    take_hidden, propose = proposer.take_hidden, proposer.propose

    def record_hidden(rows):
        for r in rows:
            seen.update({r.position + i: row for i, row in enumerate(r.rows)})
        take_hidden(rows)

    def record_proposals(decodes, num_running):
        drafts = propose(decodes, num_running)
        proposals.extend((req.copy_tokens(), draft) for req, draft in (drafts or {}).items())
        return drafts

    proposer.take_hidden, proposer.propose = record_hidden, record_proposals
    prompt = np.random.default_rng(11).integers(3, 299, 80).tolist()  # no prefix hit
    try:
        outputs(speculative, [{"prompt_token_ids": prompt}], [SamplingParams(max_tokens=12, temperature=0.0)])
    finally:
        del proposer.take_hidden, proposer.propose
    emb, e = np.asarray(model.params["embed"]["embedding"]), model.config.hidden_size
    rows = np.stack([seen[i] for i in range(80)])
    np.testing.assert_allclose(rows[:, :e], emb[prompt], rtol=1e-6)
    np.testing.assert_array_equal(rows[:, e : 2 * e], rows[:, 2 * e :])
    assert not np.allclose(rows[:, e : 2 * e], rows[:, :e])
    assert len(proposals) > 3
    params = {name: np.asarray(a) for name, a in proposer.device.params.items()}
    for tokens, draft in proposals:
        aux = np.stack([seen[i] for i in range(len(tokens) - 1)])
        assert draft == reference_chain(proposer.device.model.config, params, aux, tokens, len(draft))
    assert_kv_all_free(speculative.engine)


def test_seeded_sampling_keeps_its_distribution(plain, speculative, assert_kv_all_free):
    """The first three tokens of 160 seeded requests at temperature 1 (top-k 3), with and without EAGLE-3 drafts
    (drawn from the head's q over its draft vocabulary, mapped to target ids, verified by rejection sampling:
    the verify step takes q, so a draft is accepted with min(1, p / q), not p as a deterministic one)."""
    assert speculative.engine.runner.inputs.verify_vocab == speculative.engine.model_config.vocab_size
    prompt = PROMPTS[4]
    drafted = speculative.engine.stats.draft_tokens
    with_eagle = seeded_first_tokens(speculative, prompt, 160, 3, 0)
    assert speculative.engine.stats.draft_tokens > drafted
    assert_same_distribution(with_eagle, seeded_first_tokens(plain, prompt, 160, 3, 10_000))
    assert_kv_all_free(speculative.engine)


def test_a_head_that_predicts_the_next_token_has_its_first_drafts_accepted(model, tmp_path, assert_kv_all_free):
    """The successor target emits t + 1 after t; its head (draft ids rolled by 7 through d2t) drafts t_{i+2} from
    the embedding state, always right, then, chained on its own output, repeats that token, always wrong (k = 2)."""
    target = successor_target(model)
    llm = LLM(target, warm_up=False, speculative_config=eagle3(successor_head(tmp_path / "head", target), 2), **ENGINE)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(20, 100))}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert outputs(llm, prompts, params) == [list(range(8, 20)), list(range(100, 112))]
    stats = llm.engine.stats
    assert stats.num_drafts > 4 and stats.accepted_tokens == stats.num_drafts
    assert stats.position_accepted == [stats.num_drafts, 0] and stats.position_drafts == [stats.num_drafts] * 2
    assert_kv_all_free(llm.engine)
