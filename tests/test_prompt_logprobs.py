"""Prompt log-probabilities (vLLM's `prompt_logprobs`) on the tiny random model, against the
model's own logits at every prompt row from one whole-prompt forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.model import AttentionMetadata, KVCache
from jaxserve.outputs import TokenLogprob
from jaxserve.request import Request

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
    prefill_seq_buckets=(4,),
)


@pytest.fixture(scope="module")
def llm():
    return LLM(build_tiny_random(), **SMALL)


@pytest.fixture(autouse=True)
def pool_is_free_after(request, assert_kv_all_free):
    yield
    if "llm" in request.fixturenames:
        assert_kv_all_free(request.getfixturevalue("llm").engine)


def reference_logprobs(llm: LLM, ids: list[int]) -> np.ndarray:
    """log_softmax of the model's logits at every row of one prefill of the whole prompt."""
    runner = llm.engine.runner
    n, bs = len(ids), SMALL["block_size"]
    table = np.arange(1, -(-n // bs) + 1, dtype=np.int32)
    cache = KVCache.zeros(runner.config, len(table) + 1, bs, runner.cache_dtype)
    pos = np.arange(n)
    meta = AttentionMetadata(
        jnp.asarray(table[pos // bs] * bs + pos % bs, jnp.int32),
        jnp.asarray(table[None]),
        jnp.array([n], jnp.int32),
        jnp.array([0, n], jnp.int32),
    )
    logits, _ = jax.jit(runner.model.apply)(
        {"params": runner.params}, jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32), cache, meta, jnp.arange(n)
    )
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def check_scores(llm: LLM, ids: list[int], scores: list[TokenLogprob | None], k: int) -> None:
    ref = reference_logprobs(llm, ids)
    assert len(scores) == len(ids) and scores[0] is None
    for p in range(1, len(ids)):
        s, row = scores[p], ref[p - 1]
        assert s.token_id == ids[p]
        np.testing.assert_allclose(s.logprob, row[ids[p]], atol=2e-5)
        target = row[ids[p]]
        assert 1 + np.sum(row > target + 2e-5) <= s.rank <= 1 + np.sum(row > target - 2e-5)
        assert len(s.top) == k
        best = np.argsort(-row, kind="stable")[:k]
        np.testing.assert_allclose([lp for _, lp in s.top], row[best], atol=2e-5)
        assert [lp for _, lp in s.top] == sorted((lp for _, lp in s.top), reverse=True)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, n).tolist() for n in lengths]


def test_scores_equal_a_whole_prompt_forward_pass_across_chunks_and_batching(llm):
    # 150 tokens take three chunked-prefill steps of at most 64; the others share those steps.
    ids = prompts(0, [150, 20, 7, 40])
    wanted = [
        SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3),
        SamplingParams(max_tokens=3),
        SamplingParams(max_tokens=3, prompt_logprobs=0),
        SamplingParams(max_tokens=3, prompt_logprobs=5),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], wanted, use_tqdm=False)
    assert outs[1].prompt_logprobs is None
    for out, p, params in zip(outs, ids, wanted):
        if params.prompt_logprobs is not None:
            check_scores(llm, p, out.prompt_logprobs, params.prompt_logprobs)


def test_a_cached_prefix_is_scored_again_and_stays_cached_for_others(llm):
    ids = prompts(1, [100])[0]
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    first = llm.generate([{"prompt_token_ids": ids}], [plain], use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": ids}], [scored], use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # its rows had to be computed to be scored
    check_scores(llm, ids, again.prompt_logprobs, 1)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    later = llm.generate([{"prompt_token_ids": ids}], [plain], use_tqdm=False)[0]
    assert later.num_cached_tokens > 0 and later.prompt_logprobs is None


def test_n_choices_share_one_set_of_prompt_scores(llm):
    ids = prompts(2, [30])[0]
    out = llm.generate(
        [{"prompt_token_ids": ids}], [SamplingParams(n=3, max_tokens=2, prompt_logprobs=2, seed=1)], use_tqdm=False
    )[0]
    assert len(out.outputs) == 3
    check_scores(llm, ids, out.prompt_logprobs, 2)


def test_async_and_sync_scheduling_give_the_same_scores():
    ids = prompts(3, [90, 10])
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)] * 2
    results = []
    for overlap in (True, False):
        llm = LLM(build_tiny_random(), warm_up=False, **SMALL, async_scheduling=overlap)
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        results.append([[(s.token_id, s.logprob, s.top) for s in o.prompt_logprobs[1:]] for o in outs])
    assert results[0] == results[1]


def test_scores_of_a_recompute_are_kept_once():
    req = Request("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0), seed=0, prompt_logprobs=[None])
    assert req.num_cacheable_tokens == 0
    score = lambda p: TokenLogprob(p, -float(p), [])  # noqa: E731
    req.add_prompt_logprobs(1, [score(1), score(2)])
    assert req.num_cacheable_tokens == 2  # the row of position 2 scores position 3
    req.add_prompt_logprobs(1, [score(1), score(2), score(3)])  # a recompute launched before the read
    req.add_prompt_logprobs(4, [score(4)])
    assert [s.token_id for s in req.prompt_logprobs[1:]] == [1, 2, 3, 4]
    assert req.num_cacheable_tokens == req.num_tokens
    with pytest.raises(ValueError, match="gap"):
        req.add_prompt_logprobs(7, [score(7)])


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
