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
