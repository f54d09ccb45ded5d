"""One engine config, resolved once before anything is built: what the user asked (`EngineConfig`, checked,
never rewritten) and what the engine serves (`ResolvedConfig`, frozen), for a model's config (no weights)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from config_harness import resolved

from checkpoints.tiny_random import TINY_FAMILIES, tiny_random_config
from jaxserve.config import EngineConfig
from jaxserve.config_resolution import resolve
from jaxserve.model import KVCache
from jaxserve.model.state_cache import LinearStateCache
from jaxserve.resolved_config import ResolvedConfig
from jaxserve.speculative.config import SpeculativeConfig

# 2 layers, 2 kv heads of 16 dims, a context of 2,048 tokens: a float32 block of 16 tokens is
# 2 (K, V) x 2 layers x 2 heads x 16 dims x 16 tokens x 4 bytes = 8 KiB.
MODEL = tiny_random_config()
BLOCK_BYTES = 8192


def test_the_context_is_the_models_own_and_a_longer_setting_is_lowered_to_it(caplog):
    assert resolve(EngineConfig(num_blocks=300, block_size=8), MODEL).max_model_len == 2048
    assert resolve(EngineConfig(num_blocks=300, max_model_len=512, block_size=8), MODEL).max_model_len == 512
    with caplog.at_level(logging.WARNING, logger="jaxserve.resolved_config"):
        longer = resolve(EngineConfig(num_blocks=300, max_model_len=4096, block_size=8), MODEL)
    assert longer.max_model_len == 2048 and longer.model_context == 2048
    assert "max_model_len 4096 exceeds the model's context (2048 tokens); lowering it" in caplog.text


def test_max_model_len_is_lowered_to_what_the_kv_cache_holds_for_one_request_and_the_buckets_follow(caplog):
    asked = EngineConfig(num_blocks=101, block_size=8, max_num_seqs=4)  # 100 usable blocks, 1 kept as watermark
    with caplog.at_level(logging.WARNING, logger="jaxserve.resolved_config"):
        config = resolve(asked, MODEL)
    assert (config.max_model_len, config.watermark_blocks, config.max_blocks_per_seq) == (99 * 8, 1, 99)
    assert config.block_table_buckets == (99,)  # the width of the length served, not of the model's context
    assert "KV cache holds 99 above its watermark" in caplog.text
    assert "lowering max_model_len to 792 tokens" in caplog.text
    assert asked.max_model_len is None and asked.block_table_buckets is None  # what was asked stays as asked


def test_a_watermark_that_leaves_no_block_for_one_request_is_refused():
    assert resolve(EngineConfig(num_blocks=16, watermark_blocks=14), MODEL).max_model_len == 16
    with pytest.raises(ValueError, match=r"watermark_blocks must be in \[0, 15\), got 15"):
        resolve(EngineConfig(num_blocks=16, watermark_blocks=15), MODEL)


def test_kv_blocks_come_from_the_byte_budget_of_the_kv_heads_and_layers_as_served():
    """kv_cache_memory is per device: tensor parallelism repeats the 2 kv heads to 4 (twice the bytes a
    block) over 4 devices (four times the budget)."""
    budget = 1 << 20
    one = resolve(EngineConfig(kv_cache_memory=budget), MODEL)
    assert (one.kv_block_bytes, one.num_blocks, one.kv_storage_dtype) == (BLOCK_BYTES, budget // BLOCK_BYTES, "float32")
    tp = resolve(EngineConfig(kv_cache_memory=budget, tensor_parallel_size=4), MODEL)
    assert (tp.kv_block_bytes, tp.num_blocks) == (2 * BLOCK_BYTES, 4 * budget // (2 * BLOCK_BYTES))
    pp = resolve(EngineConfig(kv_cache_memory=budget, pipeline_parallel_size=2), MODEL)
    assert (pp.kv_block_bytes, pp.num_blocks) == (BLOCK_BYTES, 2 * budget // BLOCK_BYTES)
    bf16 = resolve(EngineConfig(kv_cache_memory=budget, dtype="bfloat16"), MODEL)  # auto: the weights' dtype
    assert bf16.kv_block_bytes == BLOCK_BYTES // 2 and bf16.num_blocks == 2 * one.num_blocks
    assert resolve(EngineConfig(num_blocks=40), MODEL).num_blocks == 40  # given: kept


def test_everything_derived_is_filled_in_once():
    config = resolve(
        EngineConfig(
            num_blocks=64,
            max_num_seqs=12,
            max_model_len=256,
            max_num_batched_tokens=64,
            enable_chunked_prefill=False,
            kv_host_bytes=4 * BLOCK_BYTES + 1,
            enable_lora=True,
            max_loras=2,
            decode_batch_buckets=(8, 2, 12, 2),
        ),
        MODEL,
    )
    assert config.dtype == "float32" and config.attention_backend  # the platform's default
    assert config.max_num_batched_tokens == 256  # without chunked prefill a whole prompt fits one step
    assert config.prefill_token_buckets == (32, 64, 128, 256)
    assert config.decode_batch_buckets == (2, 8, 12)  # as given, sorted, once each
    assert config.sampler_row_buckets == (4, 8, 12)
    assert config.block_table_buckets == (16,) and config.prefill_seq_buckets == (4,)
    assert (config.num_host_slots, config.max_cpu_loras, config.pipeline_microbatches) == (4, 2, 1)
    assert config.num_compiled_variants() == 3 + 4
    assert config.verify_batch_buckets == ()  # no speculation: no verify programs


def test_verify_programs_cover_the_decode_batches_that_speculate():
    spec = SpeculativeConfig("ngram", 3, disable_by_batch_size=5)
    config = resolve(EngineConfig(num_blocks=64, max_num_seqs=32, speculative_config=spec), MODEL)
    assert config.decode_batch_buckets == (1, 2, 4, 8, 16, 32) and config.verify_batch_buckets == (1, 2, 4, 8)


def test_the_resolved_config_is_frozen_and_so_is_what_was_asked():
    asked = EngineConfig(num_blocks=64)
    config = resolve(asked, MODEL)
    assert isinstance(config, ResolvedConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_model_len = 64  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.max_num_seqs = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        (dict(max_model_len=100), "max_model_len must be a positive multiple of block_size, got 100"),
        (dict(num_blocks=1), "num_blocks must be an integer >= 2"),
        (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1, got 0"),
        (dict(decode_batch_buckets=()), "decode_batch_buckets must be a non-empty list"),
        (dict(scheduling_policy="lifo"), "unknown scheduling_policy 'lifo'"),
        (dict(enable_lora=True, max_loras=2, max_cpu_loras=1), r"max_cpu_loras \(1\) must be >= max_loras \(2\)"),
    ],
)
def test_what_cannot_be_asked_is_refused_when_asked(settings, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig(**settings)


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        (dict(max_num_seqs=16, decode_batch_buckets=(8,)), "decode_batch_buckets must reach max_num_seqs"),
        (dict(max_model_len=256, block_table_buckets=(8,)), "block_table_buckets must reach max_model_len"),
        (dict(kv_cache_dtype="fp4"), "unknown KV cache dtype 'fp4'"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide the model's 4 query heads"),
    ],
)
def test_what_the_model_or_the_limits_cannot_serve_is_refused_when_resolved(settings, error):
    with pytest.raises(ValueError, match=error):
        resolve(EngineConfig(num_blocks=64, **settings), MODEL)


def test_the_runner_takes_only_a_resolved_config():
    from jaxserve.runner import ModelRunner

    with pytest.raises(TypeError, match="ModelRunner takes a ResolvedConfig"):
        ModelRunner(MODEL, {}, EngineConfig(num_blocks=64))


def test_host_only_tests_resolve_without_a_model():
    config = resolved(max_model_len=64, block_size=4, max_num_seqs=8)
    assert (config.max_model_len, config.block_table_buckets, config.decode_batch_buckets) == (64, (16,), (1, 2, 4, 8))


def test_a_hybrid_budget_counts_its_state_slots_and_refuses_what_it_cannot_run_yet():
    """A Gated DeltaNet hybrid: one state slot per sequence (max_num_seqs, plus the reserved slot 0) and, with
    prefix caching, one per snapshot of the state (max_num_seqs more), whose bytes come out of kv_cache_memory
    before the paged blocks; the settings it does not run with yet refused by name."""
    hybrid = tiny_random_config(**TINY_FAMILIES["qwen3_5"])
    budget = 1 << 20
    ec = resolve(EngineConfig(kv_cache_memory=budget, max_num_seqs=8), hybrid)
    slot_bytes = LinearStateCache.bytes_per_slot(hybrid)
    # per slot: 3 layers x (conv 3 x 128 + recurrent 4 x 16 x 16) f32
    assert slot_bytes == 3 * (3 * 128 + 4 * 16 * 16) * 4
    assert (ec.num_state_slots, ec.num_state_snapshots, ec.enable_prefix_caching) == (17, 8, True)
    assert ec.num_blocks == (budget - 17 * slot_bytes) // ec.kv_block_bytes
    off = resolve(EngineConfig(kv_cache_memory=budget, max_num_seqs=8, enable_prefix_caching=False), hybrid)
    assert (off.num_state_slots, off.num_state_snapshots) == (9, 0)
    assert off.num_blocks == (budget - 9 * slot_bytes) // ec.kv_block_bytes
    assert ec.kv_block_bytes == KVCache.bytes_per_block(hybrid, 16, "float32") // 4  # 1 of 4 layers is paged
    for settings, name in (
        (dict(enable_lora=True), "enable_lora"),
        (dict(speculative_config=SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})), "spec"),
    ):
        with pytest.raises(ValueError, match=f"hybrid model does not run with {name}"):
            resolve(EngineConfig(**settings), hybrid)
    assert resolve(EngineConfig(), MODEL).num_state_slots == 0
    # tensor parallel runs it (tests/sharding/test_hybrid_parallel.py) where it divides the key heads (2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's 2 Gated DeltaNet key"):
        resolve(EngineConfig(tensor_parallel_size=4), hybrid)


def test_only_a_model_whose_every_layer_slides_gets_window_sized_caches():
    """`kv_window`: Mistral's window (every layer slides); None for a model with full layers too (Gemma 3,
    gpt-oss: every block kept), with the flag off, and for a window no shorter than max_model_len."""
    mistral = tiny_random_config(**TINY_FAMILIES["mistral"])
    assert resolve(EngineConfig(num_blocks=64), mistral).kv_window == mistral.sliding_window == 8
    assert resolve(EngineConfig(num_blocks=64, sliding_window_kv=False), mistral).kv_window is None
    assert resolve(EngineConfig(num_blocks=64, max_model_len=16, block_size=4), mistral).kv_window == 8
    assert resolve(EngineConfig(num_blocks=64, max_model_len=8, block_size=4), mistral).kv_window is None
    for family in ("gemma3", "gpt_oss", "llama", "qwen3_5"):
        model = tiny_random_config(**TINY_FAMILIES[family])
        assert resolve(EngineConfig(num_blocks=64), model).kv_window is None, family
