"""The Pallas decode kernel equals the pure-JAX reference and JAX's shipped paged_attention."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as shipped_paged_attention
from paged_cases import (
    LAYER,
    SCALE,
    TOLERANCE,
    assert_close,
    block_tables,
    decode_lengths,
    interpret,
    make_cache,
    queries,
    reference_decode,
)

from kernels_pallas import decode

WIDTH = 6  # block-table width (pages per sequence)
NUM_KV_HEADS = 2


def run_both(group, block_size, dtype, seed=0, width=WIDTH, **options):
    rng = np.random.default_rng(seed)
    cache = make_cache(rng, NUM_KV_HEADS, block_size, 48, dtype)
    lengths = decode_lengths(rng, block_size, width)
    tables = block_tables(rng, lengths, width, cache.num_blocks)
    q = queries(rng, len(lengths), NUM_KV_HEADS * group, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    masking = {k: options[k] for k in ("soft_cap", "sliding_window") if k in options}
    want = reference_decode(q, cache.k, cache.v, jnp.int32(LAYER), tables, lengths, scale=SCALE, **masking)
    got = decode.decode_attention(
        q, cache.k, cache.v, jnp.int32(LAYER), tables, lengths, scale=SCALE, interpret=interpret(), **options
    )
    assert got.dtype == q.dtype
    return got, want


# Every GQA ratio and every block size, in pairs that vary both.
@pytest.mark.parametrize("group,block_size", [(1, 8), (3, 16), (4, 32), (8, 16)])
def test_matches_reference_f32(group, block_size):
    got, want = run_both(group, block_size, jnp.float32)
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert not np.asarray(got[-1]).any(), "a padded entry (length 0) must give zeros"


@pytest.mark.parametrize("group,block_size", [(1, 16), (8, 32)])
def test_matches_reference_bf16(group, block_size):
    got, want = run_both(group, block_size, jnp.bfloat16, seed=1)
    assert_close(got, want, TOLERANCE[jnp.bfloat16])


@pytest.mark.parametrize(
    "group,block_size,num_splits,pages_per_step",
    [
        (4, 8, 3, 2),  # splits of unequal use: some end past a sequence, some hold nothing
        (3, 16, 2, 1),
        (1, 32, 6, 1),  # one page per split
    ],
)
def test_flash_decoding_splits(group, block_size, num_splits, pages_per_step):
    got, want = run_both(group, block_size, jnp.float32, seed=2, num_splits=num_splits, pages_per_step=pages_per_step)
    assert_close(got, want, TOLERANCE[jnp.float32])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_soft_cap_and_sliding_window(num_splits):
    got, want = run_both(
        4, 8, jnp.float32, seed=3, soft_cap=2.0, sliding_window=13, num_splits=num_splits, pages_per_step=2
    )
    assert_close(got, want, TOLERANCE[jnp.float32])


@pytest.mark.parametrize(
    "group,block_size,dtype,k_splits",
    [
        (1, 8, jnp.float32, 1),
        (4, 16, jnp.float32, 2),
        (3, 8, jnp.bfloat16, 2),
    ],
)
def test_matches_shipped_paged_attention(group, block_size, dtype, k_splits):
    """JAX's op applies no 1/sqrt(d): give it q * scale. It takes one layer [KVH, P, PS, D]."""
    rng = np.random.default_rng(4)
    width = 8
    cache = make_cache(rng, NUM_KV_HEADS, block_size, 48, dtype)
    lengths = decode_lengths(rng, block_size, width)
    tables = block_tables(rng, lengths, width, cache.num_blocks)
    q = queries(rng, len(lengths), NUM_KV_HEADS * group, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    ours = decode.decode_attention(
        q, cache.k, cache.v, jnp.int32(LAYER), tables, lengths, scale=SCALE, interpret=interpret()
    )
    theirs = shipped_paged_attention(
        (q.astype(jnp.float32) * SCALE).astype(dtype),
        cache.k[LAYER],
        cache.v[LAYER],
        tables,
        lengths,
        block_h=16,
        pages_per_compute_block=2,
        k_splits=k_splits,
        interpret=interpret(),
    )
    # Natively the shipped op multiplies f32 in TF32 (its default precision); ours uses IEEE f32.
    tol = TOLERANCE[dtype] if interpret() or dtype == jnp.bfloat16 else 5e-3
    assert_close(ours, theirs, tol)


def test_split_and_step_heuristics():
    assert decode.default_num_splits(batch=256, num_kv_heads=8, table_steps=256) == 1
    assert decode.default_num_splits(batch=1, num_kv_heads=8, table_steps=256) == decode.MAX_SPLITS
    assert decode.default_num_splits(batch=1, num_kv_heads=8, table_steps=1) == 1
    for block_size in (8, 16, 32):
        pages = decode.default_pages_per_step(block_size, table_width=1024)
        assert pages * block_size == decode.TOKENS_PER_STEP
        assert decode.default_pages_per_step(block_size, table_width=1) * block_size >= 16


def test_rejects_heads_that_do_not_group():
    rng = np.random.default_rng(0)
    cache = make_cache(rng, 2, 8, 4, jnp.float32)
    q = queries(rng, 1, 3, jnp.float32)
    with pytest.raises(ValueError, match="kv heads"):
        decode.decode_attention(
            q, cache.k, cache.v, jnp.int32(0), jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0
        )
