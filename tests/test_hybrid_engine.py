"""A Gated DeltaNet hybrid (tiny random Qwen3.5) under memory pressure: requests preempted by
recompute (state slot freed, the prompt recomputed from zeros) or by swap (blocks to the host,
the state kept in its slot) still give transformers' greedy tokens, and every block and state
slot is free at the end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoints.hf import save_hf_dir
from checkpoints.registry import load_model
from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams

REFERENCE = json.loads((Path(__file__).parent / "data" / "family_reference.json").read_text())["tiny"]["qwen3_5"]
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=24,  # 184 tokens for 4 requests of 6 + 21 + 45 + 100 prompt and 24 new tokens each
    watermark_blocks=0,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(16,),
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = build_tiny_random(family="qwen3_5")
    directory = tmp_path_factory.mktemp("qwen3_5")
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, directory)
    return directory


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_still_match_transformers(model_dir, mode, assert_kv_all_free):
    swap = dict(preemption_mode="swap", swap_space_blocks=32) if mode == "swap" else {}
    llm = LLM(load_model(str(model_dir)), **ENGINE, **swap)
    cases = REFERENCE["cases"]
    params = SamplingParams(max_tokens=len(cases[0]["new_ids"]), temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["new_ids"], case["name"]
    assert_kv_all_free(llm.engine)


def test_a_prefix_hit_restores_the_state_snapshot(model_dir, assert_kv_all_free):
    """A prompt sharing 72 tokens with an earlier one of 75 hits the earlier prompt's last block
    boundary (72 tokens, where its state was kept), computes only the rest, and still gives
    transformers' tokens; with prefix caching off nothing is reported cached."""
    case = next(c for c in REFERENCE["cases"] if len(c["prompt_ids"]) == 100)
    earlier = case["prompt_ids"][:72] + [5, 6, 7]
    params = SamplingParams(max_tokens=len(case["new_ids"]), temperature=0.0, ignore_eos=True)
    for caching, cached in ((True, 72), (False, 0)):
        # ENGINE's 24 blocks hold both prompts without preemption, and its programs are the other tests'
        llm = LLM(load_model(str(model_dir)), **ENGINE, enable_prefix_caching=caching)
        llm.generate([{"prompt_token_ids": earlier}], SamplingParams(max_tokens=4), use_tqdm=False)
        [out] = llm.generate([{"prompt_token_ids": case["prompt_ids"]}], params, use_tqdm=False)
        assert out.num_cached_tokens == cached and llm.engine.scheduler.num_preemptions == 0
        assert out.outputs[0].token_ids == case["new_ids"]
        assert_kv_all_free(llm.engine)


def test_multi_step_decode_keeps_each_rows_state(model_dir, assert_kv_all_free):
    """Four decode steps per device loop give transformers' tokens. A row whose min_tokens ends inside a
    loop takes fewer of its steps (reading and writing the reserved state slot 0 past them), and its state
    is still its own when it goes on."""
    cases = REFERENCE["cases"]
    new = len(cases[0]["new_ids"])
    llm = LLM(load_model(str(model_dir)), **{**ENGINE, "num_blocks": 48}, num_scheduler_steps=4)  # no preemption
    params = [SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, min_tokens=m) for m in (0, 6, 3, 0)]
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["new_ids"], case["name"]
    assert llm.engine.stats.num_steps < new  # loops: one step per token would take more
    assert llm.engine.scheduler.num_preemptions == 0
    assert_kv_all_free(llm.engine)
