"""DeepSeek-V3 (tiny random model) beyond the tokens of tests/test_model_families.py: its latent
cache's bytes and the settings refused with it, its multi-token prediction weights loaded but
not run, its latent blocks moved through swap preemption and the disk tier with the same
tokens after, the engine on its Pallas decode kernel, the other ways a step runs, and its prefill
by decompression against the absorbed form."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from checkpoints.errors import UnsupportedCheckpointError
from checkpoints.hf import load_hf_dir, save_hf_dir
from checkpoints.params import iter_leaves
from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.config_resolution import resolve
from jaxserve.model import AttentionMetadata, DecoderModel, KVCache, latent_attention
from kernels_pallas.mla_backends import get_mla_backend

ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=8,
    decode_batch_buckets=(8,),
    block_table_buckets=(32,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
)
PROMPTS = [np.random.default_rng(i).integers(3, 299, n).tolist() for i, n in enumerate((90, 61, 40, 77, 23, 50))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
REFERENCE = json.loads((Path(__file__).parent / "data" / "family_reference.json").read_text())["tiny"]["deepseek_v3"]


def tokens(llm: LLM) -> list[list[int]]:
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def model():
    return build_tiny_random(family="deepseek_v3")


@pytest.fixture(scope="module")
def reference(model):
    return tokens(LLM(model, warm_up=False, num_blocks=256, **ENGINE))


def test_a_block_holds_one_latent_per_token_and_layer(model):
    cfg = model.config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # no heads: 32 values, against 2 x 4 heads x 8 of K/V
    assert KVCache.bytes_per_block(cfg, 16, jnp.float32) == cfg.num_layers * 16 * latent * 4
    cache = KVCache.zeros(cfg, 5, 16, jnp.float32)
    assert cache.k.shape == cache.v.shape == (cfg.num_layers, 1, 5, 16, latent // 2)
    # Tensor parallel: every device holds the whole latent cache, so a block costs its bytes per device.
    one, two = (resolve(EngineConfig(tensor_parallel_size=tp), cfg).kv_block_bytes for tp in (1, 2))
    assert two == 2 * one == 2 * KVCache.bytes_per_block(cfg, EngineConfig().block_size, jnp.float32)


@pytest.mark.parametrize(
    "setting, named",
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"unroll_layers": True}, "unroll_layers=True"),
        ({"enable_lora": True}, "enable_lora=True"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype=int8"),
    ],
)
def test_settings_it_is_not_served_with_are_refused_by_name(model, setting, named):
    with pytest.raises(ValueError, match=f"deepseek_v3 \\(multi-head latent attention\\) is not served with {named}"):
        resolve(EngineConfig(**setting), model.config)


@pytest.mark.parametrize("groups", [{"n_group": 3}, {"n_group": 8}, {"topk_group": 3}])
def test_expert_groups_that_cannot_route_are_refused(groups):
    """8 experts: not in 3 groups, not in 8 groups of one (a group scores its two best), not the
    best 3 of 2 groups."""
    with pytest.raises(ValueError, match="n_group"):
        build_tiny_random(family="deepseek_v3", **groups)


def test_a_checkpoint_quantized_as_published_is_refused_with_a_clear_error(model, tmp_path):
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError, match="DeepSeek-V3 quantized as 'fp8' is not supported"):
        load_hf_dir(tmp_path)


def test_multi_token_prediction_weights_are_loaded_and_not_run(model, tmp_path):
    with_mtp = build_tiny_random(family="deepseek_v3", num_nextn_predict_layers=1)
    save_hf_dir(with_mtp.params, with_mtp.config, with_mtp.tokenizer_bundle, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
    mtp = {n for n in names if n.startswith("model.layers.3.")}  # after the 3 layers, as DeepSeek stores it
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight"} <= mtp
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in mtp and "model.layers.3.self_attn.kv_b_proj.weight" in mtp
    loaded = load_hf_dir(tmp_path)
    assert loaded.config.num_nextn_predict_layers == 1
    for (path, got), (_, want) in zip(iter_leaves(loaded.params), iter_leaves(with_mtp.params), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=path)
    # The main layers' weights are the model's without them (drawn in the declaration's order,
    # `mtp` last), so its tokens are the same.
    assert dataclasses.replace(loaded.config, num_nextn_predict_layers=0) == model.config
    params = {k: v for k, v in loaded.params.items() if k != "mtp"}
    for (path, got), (_, want) in zip(iter_leaves(params), iter_leaves(model.params), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=path)
    few = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # 256 blocks, as the reference fixture: one set of compiled programs for both (the cache's)
    llm = LLM(loaded, warm_up=False, num_blocks=256, **ENGINE)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], few, use_tqdm=False)[0].outputs[0].token_ids
    assert (
        out
        == LLM(model, warm_up=False, num_blocks=256, **ENGINE)
        .generate([{"prompt_token_ids": PROMPTS[0]}], few, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_swapped_out_latent_blocks_come_back_with_the_same_tokens(model, reference, assert_kv_all_free):
    tight = LLM(model, warm_up=False, num_blocks=40, preemption_mode="swap", swap_space_blocks=200, **ENGINE)
    assert tokens(tight) == reference
    assert tight.engine.scheduler.num_preemptions > 0
    assert_kv_all_free(tight.engine)


def test_latent_blocks_read_back_from_the_disk_tier_give_the_same_tokens(model, reference, tmp_path):
    disk = {"kv_disk_dir": str(tmp_path), "kv_disk_bytes": 64 << 20, "kv_disk_min_load_tokens": 16}
    first = LLM(model, warm_up=False, num_blocks=256, **ENGINE, **disk)
    assert tokens(first) == reference
    first.close()
    second = LLM(model, warm_up=False, num_blocks=256, **ENGINE, **disk)  # a restart: only the disk holds them
    assert tokens(second) == reference
    assert second.engine.snapshot().tiers.disk_hit_tokens >= sum(len(p) // 8 * 8 - 8 for p in PROMPTS)
    second.close()


def test_the_pallas_decode_kernel_gives_transformers_tokens(model):
    """The engine on the `triton` backend (its MLA decode kernel, in interpret mode here) answers
    the reference's tokens."""
    case = REFERENCE["cases"][1]
    llm = LLM(model, warm_up=False, num_blocks=64, attention_backend="triton", **ENGINE)
    few = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": case["prompt_ids"]}], few, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == case["new_ids"][:8]


@pytest.mark.parametrize("variant", [{"dtype": "bfloat16"}, {"quantization": "int8"}])
def test_bf16_weights_and_int8_kernels_run_it(variant):
    """bf16 weights (packed kernels on CPU, a bf16 latent cache) and int8 weight-only kernels give
    the f32 reference's first tokens (those whose top-2 logit margin is 0.09 or more)."""
    case = REFERENCE["cases"][1]
    model = build_tiny_random(family="deepseek_v3", dtype=variant.get("dtype", "float32"))
    llm = LLM(model, warm_up=False, num_blocks=64, **ENGINE, **variant)
    few = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": case["prompt_ids"]}], few, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == case["new_ids"][:4]


def test_synchronous_multi_step_and_speculative_engines_give_the_same_tokens(model, reference):
    """The other ways a step is run read and write the latent cache alike: the synchronous loop,
    four decode steps per device loop, and n-gram drafts verified in one step."""
    repeating = [PROMPTS[0][:10] * 4, PROMPTS[1]]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(**options) -> tuple[list[list[int]], LLM]:
        # the reference fixture's pool size (no preemption with either): the default engine's programs
        # are then the reference's, read from the compilation cache instead of compiled again
        llm = LLM(model, warm_up=False, num_blocks=256, **ENGINE, **options)
        outs = llm.generate([{"prompt_token_ids": p} for p in repeating], greedy, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    want = run()[0]
    assert run(async_scheduling=False)[0] == want
    assert run(num_scheduler_steps=4)[0] == want
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    ngram["adaptive_draft_length"] = False
    tokens, llm = run(async_scheduling=False, speculative_config=ngram)
    assert tokens == want
    stats = llm.engine.stats
    assert stats.speculative_steps > 0 and stats.draft_tokens > 0


def chunk_logits(model, params, step, tokens: np.ndarray, chunks: list[int]) -> np.ndarray:
    """Every position's logits of `tokens` run as successive prefill steps of `chunks` rows
    (from the second on, a chunk after a prefix cached in paged blocks)."""
    block, table = 8, np.arange(3, 3 + len(tokens) // 8 + 1, dtype=np.int32)
    cache, out, start = KVCache.zeros(model.config, 32, block, jnp.float32), [], 0
    for n in chunks:
        pos = np.arange(start, start + n, dtype=np.int32)
        meta = AttentionMetadata(
            table[pos // block] * block + pos % block, table[None], np.array([start + n]), np.array([0, n])
        )
        logits, cache = step({"params": params}, tokens[start : start + n], pos, cache, meta, np.arange(n))
        out.append(np.asarray(logits))
        start += n
    return np.concatenate(out)


def test_prefill_by_decompression_gives_the_absorbed_forms_logits(model, monkeypatch):
    cfg = model.config
    assert latent_attention.decompresses(cfg, 40) and not latent_attention.decompresses(cfg, 8)
    decoder = DecoderModel(cfg, get_mla_backend("reference"))
    tokens = np.random.default_rng(0).integers(3, 299, 80).astype(np.int32)
    decompressed = chunk_logits(decoder, model.params, jax.jit(lambda *a: decoder.apply(*a)), tokens, [40, 40])
    monkeypatch.setattr(latent_attention, "decompresses", lambda config, rows: False)
    absorbed = chunk_logits(decoder, model.params, jax.jit(lambda *a: decoder.apply(*a)), tokens, [40, 40])
    np.testing.assert_allclose(decompressed, absorbed, atol=2e-5, rtol=1e-5)
