"""The Pallas ragged prefill kernel equals the pure-JAX reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import (
    LAYER,
    SCALE,
    TOLERANCE,
    assert_close,
    block_tables,
    interpret,
    make_cache,
    prefill_sequences,
    queries,
    reference_prefill,
)

from kernels_pallas import common, prefill

WIDTH = 6
NUM_KV_HEADS = 2
PADDED_ROWS = 3  # rows past query_start[-1]: a token bucket bigger than the real tokens


def run_both(group, block_size, dtype, seed=0, **options):
    rng = np.random.default_rng(seed)
    cache = make_cache(rng, NUM_KV_HEADS, block_size, 48, dtype)
    seqs = prefill_sequences(rng, block_size, WIDTH)
    seq_lens = [h + c for h, c in seqs]
    tables = block_tables(rng, seq_lens, WIDTH, cache.num_blocks)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum([c for _, c in seqs])]), jnp.int32)
    q = queries(rng, int(query_start[-1]) + PADDED_ROWS, NUM_KV_HEADS * group, dtype)
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    masking = {k: options[k] for k in ("soft_cap", "sliding_window") if k in options}
    args = (q, cache.k, cache.v, jnp.int32(LAYER), tables, seq_lens, query_start)
    want = reference_prefill(*args, scale=SCALE, **masking)
    got = prefill.prefill_attention(*args, scale=SCALE, interpret=interpret(), **options)
    assert got.dtype == q.dtype
    assert not np.asarray(got[-PADDED_ROWS:]).any(), "padding rows must give zeros"
    return got, want


@pytest.mark.parametrize("group,block_size", [(1, 16), (3, 8), (4, 32), (8, 16)])
def test_matches_reference_f32(group, block_size):
    got, want = run_both(group, block_size, jnp.float32)
    assert_close(got, want, TOLERANCE[jnp.float32])


@pytest.mark.parametrize("group,block_size", [(4, 8), (1, 32)])
def test_matches_reference_bf16(group, block_size):
    got, want = run_both(group, block_size, jnp.bfloat16, seed=1)
    assert_close(got, want, TOLERANCE[jnp.bfloat16])


@pytest.mark.parametrize("block_q,pages_per_step", [(4, 2), (16, 1)])
def test_tile_and_step_sizes(block_q, pages_per_step):
    """Tiles shorter than a chunk (several tiles per sequence) and longer than most chunks."""
    got, want = run_both(4, 16, jnp.float32, seed=2, block_q=block_q, pages_per_step=pages_per_step)
    assert_close(got, want, TOLERANCE[jnp.float32])


def test_soft_cap_and_sliding_window():
    got, want = run_both(3, 8, jnp.float32, seed=3, soft_cap=2.0, sliding_window=11, block_q=8)
    assert_close(got, want, TOLERANCE[jnp.float32])


def test_tile_layout_partitions_the_rows():
    """Every real row is in exactly one tile of its own sequence, at its own position."""
    rng = np.random.default_rng(5)
    q_lens = np.array([5, 0, 1, 16, 17, 3, 0])
    history = rng.integers(0, 40, len(q_lens))
    query_start = np.concatenate([[0], np.cumsum(q_lens)])
    seq_lens = history + q_lens
    block_q = 4
    num_tiles = -(-int(query_start[-1]) // block_q) + len(q_lens)
    tiles = np.asarray(common.tile_layout(jnp.asarray(query_start), jnp.asarray(seq_lens), num_tiles, block_q))
    owner = np.full(int(query_start[-1]), -1)
    for seq, first_row, rows, first_pos in tiles:
        assert 0 <= rows <= block_q
        for r in range(first_row, first_row + rows):
            assert owner[r] == -1
            owner[r] = seq
            assert first_pos + r - first_row == seq_lens[seq] - q_lens[seq] + r - query_start[seq]
    assert (owner == np.repeat(np.arange(len(q_lens)), q_lens)).all()
