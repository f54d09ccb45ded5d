"""Every family reproduces Hugging Face transformers' greedy tokens (f32, the same random
checkpoint), served by the engine with no compilation after warm-up and the KV pool free after;
mixture-of-experts engines report their expert load (per step and in total) in `/metrics`.

Tiny random models of each family (`checkpoints.tiny_random.TINY_FAMILIES`): Llama, Qwen2 (q/k/v
biases), Qwen3 (q/k norms), Mistral (a sliding window of 8 tokens, shorter than the prompts),
Gemma 3 (interleaved local and global layers, GeGLU, four norms, scaled embeddings), Mixtral and
Qwen3-MoE (mixture of experts, top-2 of 4 renormalised / of 8 not), Qwen3.5 (Gated DeltaNet
layers and gated full attention, a prompt longer than a prefill chunk: its state carried across
chunks in a state slot), Qwen3-Next (the same layers with experts and a sigmoid-gated shared expert,
Gated DeltaNet projections fused by key head). Their weights are drawn from
the declaration with seed 0 and written as a Hugging Face directory, which the engine loads;
transformers loaded the same directory for tests/data/family_reference.json
(tests/data/make_family_reference.py), so no weights are committed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from checkpoints.architectures import config_from_hf
from checkpoints.hf import save_hf_dir
from checkpoints.registry import load_model
from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from server.metrics import ServerMetrics

REFERENCE = json.loads((Path(__file__).parent / "data" / "family_reference.json").read_text())["tiny"]
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=96,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(16,),
)


@pytest.fixture(scope="module", params=sorted(REFERENCE))
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    model = build_tiny_random(family=family, seed=REFERENCE[family]["seed"])
    directory = tmp_path_factory.mktemp(family)
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, directory)
    weights = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    assert weights == REFERENCE[family]["weights_sha256"], "the random weights differ from those of the reference"
    return family, directory


def test_greedy_tokens_match_transformers_with_no_compilation_after_warm_up(family_dir, assert_kv_all_free):
    family, directory = family_dir
    llm = LLM(load_model(str(directory)), **ENGINE)
    assert llm.engine.model_config.architecture == family
    compiled = llm.engine.num_compilations
    cases = REFERENCE[family]["cases"]
    params = SamplingParams(max_tokens=len(cases[0]["new_ids"]), temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["new_ids"], f"{family} {case['name']}"
    assert llm.engine.num_compilations == compiled
    assert_kv_all_free(llm.engine)
    check_expert_load(llm, cases)


def check_expert_load(llm: LLM, cases: list[dict]) -> None:
    """A mixture-of-experts engine counts every real token's assignments (k per layer; padding rows
    none) and `/metrics` shows them per expert; a dense one reports no experts."""
    config, snapshot = llm.engine.model_config, llm.engine.snapshot()
    if not config.num_experts:
        assert snapshot.expert_tokens == () and "moe_expert" not in ServerMetrics().render(snapshot, True).decode()
        return
    per_token = config.num_experts_per_tok * config.num_layers
    computed = sum(len(c["prompt_ids"]) + len(c["new_ids"]) - 1 for c in cases)  # the last token is never fed
    assert len(snapshot.expert_tokens) == config.num_experts
    assert sum(snapshot.expert_tokens) == computed * per_token
    last = sum(snapshot.expert_load)  # the last step read: at most one token per sequence
    assert 0 < last <= len(cases) * per_token and last % per_token == 0
    text = ServerMetrics().render(snapshot, True).decode()
    for expert, count in enumerate(snapshot.expert_tokens):
        assert f'jaxserve_moe_expert_tokens_total{{expert="{expert}"}} {float(count)}' in text
        assert f'jaxserve_moe_expert_load{{expert="{expert}"}} {float(snapshot.expert_load[expert])}' in text


@pytest.mark.parametrize("family", [f for f in sorted(REFERENCE) if "transformers_config" in REFERENCE[f]])
def test_loader_reads_the_config_transformers_writes(family):
    """The config.json transformers itself writes (`save_pretrained`, recorded in the reference)
    reads to the config of the model it was written for."""
    assert config_from_hf(REFERENCE[family]["transformers_config"]) == build_tiny_random(family=family).config
