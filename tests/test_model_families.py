"""Every family reproduces Hugging Face transformers' greedy tokens (f32, the same random
checkpoint), served by the engine with no compilation after warm-up and the KV pool free after;
mixture-of-experts engines report their expert load (per step and in total) in `/metrics`.

Tiny random models of each family (`checkpoints.tiny_random.TINY_FAMILIES`): Llama, Qwen2 (q/k/v
biases), Qwen3 (q/k norms), Mistral (a sliding window of 8 tokens, shorter than the prompts),
Gemma 3 (interleaved local and global layers, GeGLU, four norms, scaled embeddings), Mixtral and
Qwen3-MoE (mixture of experts, top-2 of 4 renormalised / of 8 not), DeepSeek-V3 (multi-head latent
attention with YaRN and interleaved RoPE, a dense layer then shared and group-limited routed
experts), gpt-oss (attention sinks, alternating sliding / full layers, YaRN, biased experts under a
clamped SwiGLU, and the same with MXFP4 experts; a prompt longer than a prefill chunk, and one that
shares 40 tokens with it, run after the others from the prefix cache), Qwen3.5 (Gated DeltaNet
layers and gated full attention, a prompt longer than a prefill chunk: its state carried across
chunks in a state slot), Qwen3-Next (the same layers with experts and a sigmoid-gated shared expert,
Gated DeltaNet projections fused by key head). Their weights are drawn from
the declaration with seed 0 and written as a Hugging Face directory, which the engine loads;
transformers loaded the same directory for tests/data/family_reference.json
(tests/data/make_family_reference.py), so no weights are committed. The `config.json` transformers
itself writes reads back to the same config.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from checkpoints.architectures import config_from_hf
from checkpoints.hf import save_hf_dir
from checkpoints.registry import load_model
from checkpoints.tiny_random import TINY_FAMILIES, build_tiny_random
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
    assert llm.engine.model_config.architecture == TINY_FAMILIES[family].get("architecture", "llama")
    compiled = llm.engine.num_compilations
    cases = REFERENCE[family]["cases"]
    params = SamplingParams(max_tokens=len(cases[0]["new_ids"]), temperature=0.0, ignore_eos=True)
    first = [c for c in cases if "shared_prefix" not in c]
    later = [c for c in cases if "shared_prefix" in c]  # after the prompts whose blocks they share
    cached = 0
    for batch in (first, later):
        outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in batch], params, use_tqdm=False)
        for case, out in zip(batch, outs):
            assert out.outputs[0].token_ids == case["new_ids"], f"{family} {case['name']}"
            assert out.num_cached_tokens > 0 or batch is first, f"{family} {case['name']}: no prefix-cache hit"
            cached += out.num_cached_tokens
    assert llm.engine.num_compilations == compiled
    assert_kv_all_free(llm.engine)
    check_expert_load(llm, cases, cached)
    if llm.engine.model_config.experts_mxfp4:  # served as stored: no float expert kernels on the device
        layers = llm.engine.runner.params["layers"]
        for name in ("expert_gate_up", "expert_down"):
            assert set(layers[name]) == {"blocks", "scales", "bias"} and layers[name]["blocks"].dtype == jnp.uint8


def check_expert_load(llm: LLM, cases: list[dict], cached: int) -> None:
    """A mixture-of-experts engine counts every real token's assignments (k per layer; padding rows
    and the `cached` prompt tokens read from the prefix cache none) and `/metrics` shows them per
    expert; a dense one reports no experts."""
    config, snapshot = llm.engine.model_config, llm.engine.snapshot()
    if not config.num_experts:
        assert snapshot.expert_tokens == () and "moe_expert" not in ServerMetrics().render(snapshot, True).decode()
        return
    per_token = config.num_experts_per_tok * config.moe_layers  # DeepSeek-V3's first layers are dense
    computed = sum(len(c["prompt_ids"]) + len(c["new_ids"]) - 1 for c in cases)  # the last token is never fed
    computed -= cached  # prefix-cache hits are not computed again
    assert len(snapshot.expert_tokens) == config.num_experts
    assert sum(snapshot.expert_tokens) == computed * per_token
    last = sum(snapshot.expert_load)  # the last step read: at most one token per sequence
    assert 0 < last <= len(cases) * per_token and last % per_token == 0
    text = ServerMetrics().render(snapshot, True).decode()
    for expert, count in enumerate(snapshot.expert_tokens):
        assert f'jaxserve_moe_expert_tokens_total{{expert="{expert}"}} {float(count)}' in text
        assert f'jaxserve_moe_expert_load{{expert="{expert}"}} {float(snapshot.expert_load[expert])}' in text


# Prompts of up to 45 tokens in chunks of 16: every prompt but the shortest takes several steps.
CHUNKED = {**ENGINE, "max_num_batched_tokens": 16, "prefill_token_buckets": (16,)}


def test_chunked_prompts_and_a_cached_prefix_match_transformers(family_dir, assert_kv_all_free):
    """Chunked prefill, then a prompt sharing its first 40 tokens with the longest one: its
    cached blocks are read (cached tokens > 0) and the tokens still equal transformers'."""
    family, directory = family_dir
    reference = REFERENCE[family]
    if "shared_prefix_case" not in reference:
        pytest.skip(f"{family}'s reference predates the shared-prefix case (make_family_reference.py --only {family})")
    llm = LLM(load_model(str(directory)), warm_up=False, **CHUNKED)  # no compilation count checked here
    longest, shared = reference["cases"][-1], reference["shared_prefix_case"]
    params = SamplingParams(max_tokens=len(longest["new_ids"]), temperature=0.0, ignore_eos=True)
    for case, cached in ((longest, False), (shared, True)):
        out = llm.generate([{"prompt_token_ids": case["prompt_ids"]}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == case["new_ids"], f"{family} {case['name']}"
        assert (out.num_cached_tokens > 0) == cached, out.num_cached_tokens
    assert_kv_all_free(llm.engine)


def test_config_written_by_transformers_loads_to_the_same_config(family_dir):
    family, _ = family_dir
    if "hf_config" not in REFERENCE[family]:
        pytest.skip(f"{family}'s reference predates the recorded config.json")
    assert config_from_hf(REFERENCE[family]["hf_config"]) == build_tiny_random(family=family).config
