"""Every attention backend gives the same output when a sliding-window sequence's blocks wholly
before its window are dropped from its table (entries set to the reserved block 0, as
`jaxserve.kv.window` does) as with every block there: no backend reads a dropped entry unmasked.
Block 0 holds large values, so a read of it would show."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import HEAD_DIM, LAYER, SCALE, TOLERANCE, assert_close, block_tables, make_cache, queries

from jaxserve.kv.window import first_needed_block
from kernels_pallas import cpu_build, get_attention_backend

BLOCK, WIDTH, WINDOW, KV_HEADS, GROUP = 8, 8, 13, 2, 3
BACKENDS = ["reference", "jax", "triton"] + (["cpu"] if cpu_build.available() else [])


def poisoned_cache(seed: int):
    cache = make_cache(np.random.default_rng(seed), KV_HEADS, BLOCK, 48, jnp.float32)
    cache.k = cache.k.at[:, :, 0].set(1e3)
    cache.v = cache.v.at[:, :, 0].set(1e3)
    return cache


def dropped(tables: jnp.ndarray, first_queries: list[int]) -> jnp.ndarray:
    """`tables` with each row's entries before the window of its first query set to block 0."""
    out = np.array(tables)
    for row, first in enumerate(first_queries):
        out[row, : first_needed_block(WINDOW, BLOCK, max(first, 0))] = 0
    assert (out != np.asarray(tables)).any()
    return jnp.asarray(out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_ignores_dropped_entries(backend):
    cache = poisoned_cache(0)
    lengths = [5, 8, 23, 40, WIDTH * BLOCK, 17, 0]
    tables = block_tables(np.random.default_rng(1), lengths, WIDTH, cache.num_blocks)
    q = queries(np.random.default_rng(2), len(lengths), KV_HEADS * GROUP, jnp.float32)
    decode = get_attention_backend(backend).decode

    def run(t):
        n = jnp.asarray(lengths, jnp.int32)
        return decode(q, cache.k, cache.v, jnp.int32(LAYER), t, n, scale=SCALE, sliding_window=WINDOW)

    assert_close(run(dropped(tables, [n - 1 for n in lengths])), run(tables), TOLERANCE[jnp.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_ignores_dropped_entries(backend):
    cache = poisoned_cache(3)
    chunks = [(0, 10), (11, 10), (16, 1), (30, 7), (WIDTH * BLOCK - 5, 5), (0, 0)]  # (history, new tokens)
    seq_lens = [h + n for h, n in chunks]
    tables = block_tables(np.random.default_rng(4), seq_lens, WIDTH, cache.num_blocks)
    starts = np.concatenate([[0], np.cumsum([n for _, n in chunks])]).astype(np.int32)
    rows = 48  # padded past the last sequence's rows
    q = queries(np.random.default_rng(5), rows, KV_HEADS * GROUP, jnp.float32)
    prefill = get_attention_backend(backend).prefill

    def run(t):
        lens, query_start = jnp.asarray(seq_lens, jnp.int32), jnp.asarray(starts)
        return prefill(q, cache.k, cache.v, jnp.int32(LAYER), t, lens, query_start, scale=SCALE, sliding_window=WINDOW)

    got, want = run(dropped(tables, [h for h, _ in chunks])), run(tables)
    assert got.shape == (rows, KV_HEADS * GROUP, HEAD_DIM)
    assert_close(got, want, TOLERANCE[jnp.float32])
