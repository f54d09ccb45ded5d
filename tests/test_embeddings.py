"""Embeddings (`SamplingParams.pooling`) on the tiny random model: the pooled final hidden states
equal those of one whole-prompt forward pass, however the prompt is chunked, batched with other
requests, found in the prefix cache or preempted and recomputed; nothing is generated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.model import AttentionMetadata, KVCache
from jaxserve.model.head import final_norm
from jaxserve.pooling import PromptPooling

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


def reference(llm: LLM, ids: list[int], kind: str) -> np.ndarray:
    """The last row's, the first's, or the mean of every row's, final hidden state (after the final norm) of one
    prefill of the whole prompt."""
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

    def hidden(params, tokens, positions):
        _, state = runner.model.apply(
            {"params": params}, tokens, positions, cache, meta, jnp.arange(n), mutable=["intermediates"]
        )
        return final_norm(runner.config, params, state["intermediates"]["hidden"][0])

    rows = np.asarray(
        jax.jit(hidden)(runner.params, jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32)), np.float64
    )
    return {"last": rows[-1], "cls": rows[0], "mean": rows.mean(axis=0)}[kind]


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, n).tolist() for n in lengths]


def test_embeddings_equal_a_whole_prompt_forward_pass_across_chunks_and_batching(llm):
    # 150 tokens take three chunked-prefill steps of at most 64; the others share those steps, and a
    # generation runs beside them.
    ids = prompts(0, [150, 20, 7, 40, 33])
    kinds = ["mean", "last", "mean", None, "last"]
    params = [SamplingParams.for_pooling(k) if k else SamplingParams(max_tokens=5, ignore_eos=True) for k in kinds]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for out, p, kind in zip(outs, ids, kinds):
        if kind is None:
            assert out.embedding is None and len(out.outputs[0].token_ids) == 5
            continue
        assert out.outputs[0].token_ids == [] and out.outputs[0].text == "" and out.outputs[0].finish_reason == "stop"
        assert out.embedding.dtype == np.float32 and out.embedding.shape == (llm.engine.model_config.hidden_size,)
        np.testing.assert_allclose(out.embedding, reference(llm, p, kind), atol=2e-5, rtol=1e-5)


def test_last_pooling_uses_the_prefix_cache_and_mean_pooling_computes_every_row(llm):
    ids = prompts(1, [100])[0]
    plain = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 0
    mean, last = (
        llm.generate([{"prompt_token_ids": ids}], SamplingParams.for_pooling(k), use_tqdm=False)[0]
        for k in ("mean", "last")
    )
    assert mean.num_cached_tokens == 0  # its rows had to be computed to be pooled
    assert last.num_cached_tokens >= 88
    np.testing.assert_allclose(mean.embedding, reference(llm, ids, "mean"), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(last.embedding, reference(llm, ids, "last"), atol=2e-5, rtol=1e-5)
    embedded = prompts(2, [60])[0]
    llm.embed([{"prompt_token_ids": embedded}], pooling="mean", use_tqdm=False)
    after = llm.generate([{"prompt_token_ids": embedded}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert after.num_cached_tokens == 56  # an embedding's blocks serve later prompts


def test_cls_pooling_computes_its_first_row_even_when_the_prompt_is_cached(llm):
    ids = prompts(3, [70])[0]
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2), use_tqdm=False)
    cls = llm.generate([{"prompt_token_ids": ids}], SamplingParams.for_pooling("cls"), use_tqdm=False)[0]
    assert cls.num_cached_tokens == 0  # row 0 is pooled, so it is computed, not taken from the cache
    np.testing.assert_allclose(cls.embedding, reference(llm, ids, "cls"), atol=2e-5, rtol=1e-5)


def test_a_preempted_embedding_is_recomputed_and_pools_each_row_once():
    # 40 blocks of 8: the generation grows until the embedding admitted after it is preempted.
    llm = LLM(build_tiny_random(), warm_up=False, **{**SMALL, "num_blocks": 40})
    gen, emb = prompts(3, [100, 230])
    outs = llm.generate(
        [{"prompt_token_ids": gen}, {"prompt_token_ids": emb}],
        [SamplingParams(max_tokens=150, ignore_eos=True), SamplingParams.for_pooling("mean")],
        use_tqdm=False,
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(outs[0].outputs[0].token_ids) == 150
    np.testing.assert_allclose(outs[1].embedding, reference(llm, emb, "mean"), atol=2e-5, rtol=1e-5)


def test_rows_launched_again_by_a_recompute_are_pooled_once():
    pooling = PromptPooling("mean")
    assert pooling.first_needed(10) == 0
    first = pooling.positions(0, 6, 10)
    pooling.on_launched(first)
    assert first == range(0, 6) and pooling.first_needed(10) == 6
    assert pooling.positions(0, 8, 10) == range(6, 8)  # a recompute from 0: rows 0-5 are pooled already
    last = PromptPooling("last")
    assert last.positions(0, 6, 10) == range(9, 6) and last.positions(6, 4, 10) == range(9, 10)
    assert last.first_needed(10) is None
    last.on_launched(range(9, 10))
    assert not last.positions(8, 2, 10)
    pooling.add(np.ones(3), 6)
    pooling.add(np.full(3, 2.0), 4)
    np.testing.assert_allclose(pooling.vector(), np.full(3, 0.3))


@pytest.mark.parametrize(
    "fields",
    [
        dict(pooling="max"),
        dict(pooling="last", max_tokens=2),
        dict(pooling="mean", n=2, max_tokens=1),
        dict(pooling="last", max_tokens=1, logprobs=0),
    ],
)
def test_bad_pooling_requests_are_refused(fields):
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(**fields)
