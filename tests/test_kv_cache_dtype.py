"""`--kv-cache-dtype` in the engine (tiny random model): the pool holds more blocks in the same
bytes, rows and their scales survive swaps and the disk tier, and a disk directory (or KV handed
between workers) is keyed by the KV dtype. Accuracy on the default model:
test_kv_cache_dtype_accuracy.py."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tier_engines import TIER_ENGINE, random_prompts, run

from checkpoints.tiny_random import build_tiny_random, tiny_random_config
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.kv import CopyKind, DiskTier, HostBlockArrays, fingerprint
from jaxserve.kv_tiers import kv_fingerprint
from jaxserve.model import KVCache
from jaxserve.runner.block_moves import BlockMover
from kernels_pallas import kv_quant

PROMPTS = random_prompts(150, 97, 40)


def test_block_bytes_follow_the_dtype_and_scales():
    """Bytes per block (what num_blocks from --kv-cache-memory divides by) of the default model's
    shapes: bf16 half of f32; int8 and fp8 a quarter plus 4 scale bytes per 64-value row."""
    config = tiny_random_config(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    sizes = {
        name: KVCache.bytes_per_block(config, 16, kv_quant.storage_dtype(name, jnp.float32, "cpu"))
        for name in ("auto", "bfloat16", "int8", "fp8")
    }
    f32 = 2 * 30 * 3 * 64 * 16 * 4
    assert sizes == {"auto": f32, "bfloat16": f32 // 2, "int8": f32 // 4 * 68 // 64, "fp8": f32 // 4 * 68 // 64}


def test_swaps_keep_rows_and_scales():
    """Device -> host -> device moves whole rows: an int8 block comes back byte for byte, scales included."""
    k, v = np.random.default_rng(0).standard_normal((2, 2, 2, 10, 4, 16)) * 5
    cache = KVCache(kv_quant.quantize(jnp.asarray(k), jnp.int8), kv_quant.quantize(jnp.asarray(v), jnp.int8))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mover = BlockMover(cache, one, one, num_host_blocks=4)
    before = (np.asarray(cache.k), np.asarray(cache.v))
    cache = mover.move(cache, CopyKind.DEVICE_TO_HOST, [3, 5], [0, 1])
    cache = mover.move(cache, CopyKind.HOST_TO_DEVICE, [0, 1], [7, 8])
    for got, want in zip((cache.k, cache.v), before):
        np.testing.assert_array_equal(np.asarray(got)[:, :, [7, 8]], want[:, :, [3, 5]])
    assert mover.host_k.dtype == np.int8 and mover.host_k.shape[-1] == 16 + kv_quant.SCALE_ELEMENTS


def test_disk_files_keep_rows_and_scales(tmp_path):
    """Blocks of an int8 host tier written to the disk tier and read back into other host slots come
    back byte for byte, scales included (what the engine's disk writes and loads do)."""
    rng = np.random.default_rng(1)
    host = []
    for _ in range(2):
        rows = np.array(kv_quant.quantize(jnp.asarray(rng.standard_normal((2, 2, 4, 8, 16)) * 3), jnp.int8))
        host.append(HostBlockArrays.allocate(rows.shape, rows.dtype))
        host[-1][...] = rows
    written = [a.copy() for a in host]
    disk = DiskTier(tmp_path, fingerprint({"kv_cache_dtype": "int8"}), 8, HostBlockArrays(host), 1 << 20)
    keys, tokens = [bytes([i]) * 16 for i in (1, 2)], [bytes(32), bytes(32)]
    disk.write([disk.plan_write(k, t) for k, t in zip(keys, tokens)], [a[:, :, [0, 1]] for a in host])
    disk.flush()
    for a in host:
        a[:] = 0
    disk.start_load(keys, tokens, [2, 3])
    assert disk.wait(30.0) and disk.poll()[0].loaded == 2
    for got, want in zip(host, written):
        np.testing.assert_array_equal(got[:, :, [2, 3]], want[:, :, [0, 1]])
    disk.close()


def test_the_fingerprint_covers_the_kv_dtype():
    """Disk files and KV handed between workers are keyed by it: another KV dtype never reads them."""
    runner = types.SimpleNamespace(
        config="cfg",
        engine_config=EngineConfig(),
        weights_digest="w",
        dtype=jnp.float32,
        attention_backend="cpu",
        stages=None,
    )
    prints = {
        kv_fingerprint(types.SimpleNamespace(**vars(runner), kv_dtype=dtype), "m")
        for dtype in (jnp.float32, jnp.uint16, jnp.bfloat16, jnp.int8, jnp.uint8)
    }
    assert len(prints) == 4  # bf16 bits (CPU) and bf16 (GPU) are one format


def test_an_fp8_engine_compiles_nothing_after_warm_up(assert_kv_all_free):
    """Warm-up compiles the quantizing writes and reads with every bucket; a mixed workload (prefill
    chunks, decodes, logprobs) then compiles nothing and leaves the pool free."""
    llm = LLM(
        build_tiny_random(),
        kv_cache_dtype="fp8",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=128,
        block_size=8,
        decode_batch_buckets=(4,),
        prefill_token_buckets=(32,),
        prefill_seq_buckets=(2,),
        sampler_row_buckets=(4,),
        block_table_buckets=(16,),
        num_blocks=64,
    )
    assert llm.engine.runner.cache.k.dtype == jnp.uint8
    before = llm.engine.num_compilations
    params = [
        SamplingParams(max_tokens=n, temperature=t, logprobs=k, seed=i)
        for i, (n, t, k) in enumerate([(9, 0.0, 0), (3, 0.8, 2), (12, 0.0, 1)])
    ]
    outs = llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 70)], params, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert llm.engine.num_compilations == before
    assert_kv_all_free(llm.engine)


@pytest.mark.slow  # ~30 s: two engines; CI: test_disk_files_keep_rows_and_scales and the kernel tests
def test_int8_blocks_survive_the_disk_tier(tmp_path, assert_kv_all_free):
    """After a restart on an int8 engine's disk directory, an int8 engine loads the prompts' blocks
    (rows with their scales) and serves the greedy tokens of the first run; the pool holds more
    blocks than f32's in the same bytes (the engine's own accounting)."""
    config = {
        **TIER_ENGINE,
        "num_blocks": None,
        "kv_cache_memory": 96 * 2 * 2 * 2 * 8 * 16 * 4,  # 96 f32 blocks
        "kv_disk_dir": str(tmp_path),
        "kv_disk_bytes": 64 << 20,
        "kv_cache_dtype": "int8",
    }
    first = LLM(build_tiny_random(), warm_up=False, **config)
    assert first.engine.runner.cache.k.dtype == jnp.int8 and first.engine.runner.num_blocks == 96 * 4 * 16 // 20
    tokens = run(first, PROMPTS)[0]
    assert_kv_all_free(first.engine)
    first.close()

    second = LLM(build_tiny_random(), warm_up=False, **config)
    again, cached = run(second, PROMPTS)
    assert again == tokens and cached[:2] == [144, 96]
    assert second.engine.snapshot().tiers.disk_hit_tokens >= 144 + 96
    assert_kv_all_free(second.engine)
    second.close()
