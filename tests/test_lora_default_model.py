"""LoRA adapters on the default model (SmolLM2-135M, 30 layers): each adapter's greedy tokens
equal transformers + PEFT's (tests/data/lora_reference.json), alone and in one batch with the base
model, in f32 with the CPU's default kernels, and nothing compiles after warm-up. The tiny model's
tests (test_lora_engine.py) cover the same code in CI; this one is the slow tier."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jaxserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent / "data"))
from lora_adapters import DEFAULT_ADAPTERS, module_features, write_adapter  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REFERENCE = json.loads((Path(__file__).parent / "data" / "lora_reference.json").read_text())["default"]
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=256,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(16,),
    num_blocks=96,
    dtype="float32",
    enable_lora=True,
    max_loras=2,
    max_lora_rank=16,
)


def test_default_model_adapters_match_peft(tmp_path, assert_kv_all_free):
    llm = LLM(**ENGINE)
    config = llm.engine.model_config
    features = module_features(
        config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim
    )
    for spec in DEFAULT_ADAPTERS:
        llm.engine.add_lora(spec.name, str(write_adapter(tmp_path / spec.name, spec, config.num_layers, features)))
    compiled = llm.engine.num_compilations
    runs = [(None, c) for c in REFERENCE["base"]["cases"]]
    runs += [(name, c) for name, entry in REFERENCE["adapters"].items() for c in entry["cases"]]
    params = [
        SamplingParams(max_tokens=len(c["new_ids"]), temperature=0.0, ignore_eos=True, lora=name) for name, c in runs
    ]
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for _, c in runs]
    for prompt, p, (name, case) in zip(prompts, params, runs):
        assert llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids == case["new_ids"], name
    together = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == [c["new_ids"] for _, c in runs]
    base = [c["new_ids"] for c in REFERENCE["base"]["cases"]]
    for entry in REFERENCE["adapters"].values():  # every adapter changes the output of some prompt
        assert [c["new_ids"] for c in entry["cases"]] != base
    assert llm.engine.num_compilations == compiled
    assert_kv_all_free(llm.engine)
    assert llm.engine.lora.num_pinned == 0
