"""The default model reproduces Hugging Face transformers (f32, same GGUF) token for token.

Reference data: tests/data/smollm2_reference.json, made by tests/data/make_reference.py.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.registry import DEFAULT_MODEL, load_model
from jaxserve.model import AttentionMetadata, DecoderModel, KVCache
from kernels_pallas import get_attention_backend

pytestmark = pytest.mark.integration
REFERENCE = json.loads((Path(__file__).parent / "data" / "smollm2_reference.json").read_text())


@pytest.fixture(scope="module")
def smollm2():
    return load_model(DEFAULT_MODEL)


ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=128,
    max_model_len=256,
    decode_batch_buckets=(8,),
    sampler_row_buckets=(8,),
    prefill_token_buckets=(128,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(16,),
    num_blocks=128,
)


@pytest.fixture(scope="module")
def llm(smollm2):
    from jaxserve import LLM

    return LLM(smollm2, **ENGINE)


def test_last_position_logits_match_transformers(smollm2):
    model = DecoderModel(smollm2.config, get_attention_backend("reference"))
    step = jax.jit(model.apply)
    for case in REFERENCE["greedy"]:
        ids = case["prompt_ids"]
        n = len(ids)
        cache = KVCache.zeros(smollm2.config, 8, 16, jnp.float32)
        table = np.arange(1, 8, dtype=np.int32)
        kv_slots = table[np.arange(n) // 16] * 16 + np.arange(n) % 16
        meta = AttentionMetadata(jnp.asarray(kv_slots), jnp.asarray(table[None]), jnp.array([n]), jnp.array([0, n]))
        logits, _ = step({"params": smollm2.params}, jnp.asarray(ids), jnp.arange(n), cache, meta, jnp.array([n - 1]))
        logits = np.asarray(logits[0])
        top = case["last_logits_top20"]
        np.testing.assert_allclose(logits[top["ids"]], top["values"], atol=1e-3, rtol=0, err_msg=case["name"])
        assert int(logits.argmax()) == case["last_logits_argmax"]


def test_greedy_tokens_match_transformers(llm, assert_kv_all_free):
    from jaxserve import SamplingParams

    cases = REFERENCE["greedy"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["new_ids"], case["name"]
    assert_kv_all_free(llm.engine)


def test_speculative_greedy_tokens_match_transformers(smollm2, assert_kv_all_free):
    """N-gram speculative decoding (drafts verified in one step) keeps greedy output token for
    token: the golden prompts batched (one verify program of 8 rows) and one alone."""
    from jaxserve import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec["adaptive_draft_length"] = False
    llm = LLM(smollm2, warm_up=False, speculative_config=spec, **ENGINE)
    cases = REFERENCE["greedy"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["new_ids"], case["name"]
    code = next(c for c in cases if c["name"] == "code")
    assert (
        llm.generate({"prompt_token_ids": code["prompt_ids"]}, params, use_tqdm=False)[0].outputs[0].token_ids
        == code["new_ids"]
    )
    stats = llm.engine.stats
    assert stats.accepted_tokens > 0 and stats.speculative_steps > 0
    assert_kv_all_free(llm.engine)


def test_multi_step_greedy_tokens_match_transformers(smollm2, assert_kv_all_free):
    """Multi-step decode (8 decode steps per device loop) keeps greedy output token for token:
    the golden prompts batched, then one alone."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(smollm2, warm_up=False, num_scheduler_steps=8, **ENGINE)
    cases = REFERENCE["greedy"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["new_ids"], case["name"]
    steps_before = llm.engine.stats.num_steps
    out = llm.generate({"prompt_token_ids": cases[0]["prompt_ids"]}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == cases[0]["new_ids"]
    assert llm.engine.stats.num_steps - steps_before == 1 + 4  # the prefill's token, then 31 in 4 loops
    assert_kv_all_free(llm.engine)


def test_prompt_logprobs_match_transformers(llm, assert_kv_all_free):
    """vLLM's prompt_logprobs (lm-eval-harness's loglikelihood path) against transformers' log_softmax
    at every prompt position (tests/data/smollm2_prompt_logprobs.json, by make_prompt_logprobs.py)."""
    from jaxserve import SamplingParams

    cases = json.loads((Path(__file__).parent / "data" / "smollm2_prompt_logprobs.json").read_text())["prompts"]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        got = [s.logprob for s in out.prompt_logprobs[1:]]
        np.testing.assert_allclose(got, case["logprobs"], atol=1e-3, rtol=0, err_msg=case["name"])
    assert_kv_all_free(llm.engine)


def test_the_default_model_serves_its_whole_context_by_default(smollm2, assert_kv_all_free):
    """No --max-model-len: the model's own 8,192 tokens, so a 2,100-token prompt is served
    (the engine once capped every model at 2,048)."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(
        smollm2,
        warm_up=False,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        num_blocks=8192 // 16 + 16,
        decode_batch_buckets=(4,),
        sampler_row_buckets=(4,),
        prefill_token_buckets=(512,),
        prefill_seq_buckets=(4,),
    )
    assert llm.engine.config.max_model_len == 8192
    ids = [int(i) for i in np.random.default_rng(0).integers(100, 40000, 2100)]
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_kv_all_free(llm.engine)
