"""Both plain-JAX backends equal a plain NumPy attention, row by row over each row's own
sequence, on a ragged step that mixes long chunks, chunks over long histories, single rows and
an empty sequence: the reference (the oracle of the Pallas kernels, so it gets one too) and
`paged_jax` (the CPU default, which walks the block tables only up to each tile's last key)."""

import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import LAYER, PLAIN_JAX, SCALE, TOLERANCE, assert_close, block_tables, make_cache, queries

NUM_KV_HEADS = 2
GROUP = 3
BLOCK_SIZE = 16
WIDTH = 40  # 640 keys
PADDED_ROWS = 5


def numpy_attention(q, k_cache, v_cache, tables, seq_lens, query_start, soft_cap=None, window=None):
    """float64, one sequence at a time, over exactly its first seq_lens[s] cached tokens."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    out = np.zeros_like(q)
    for s in range(len(seq_lens)):
        lo, hi, n_keys = query_start[s], query_start[s + 1], seq_lens[s]
        if hi == lo or n_keys == 0:  # no rows, or a padding entry of decode: zeros
            continue
        pages = tables[s, : -(-n_keys // BLOCK_SIZE)]
        k = k_cache[LAYER][:, pages].reshape(NUM_KV_HEADS, -1, q.shape[-1])[:, :n_keys]
        v = v_cache[LAYER][:, pages].reshape(NUM_KV_HEADS, -1, q.shape[-1])[:, :n_keys]
        rows = q[lo:hi].reshape(hi - lo, NUM_KV_HEADS, -1, q.shape[-1])
        scores = np.einsum("nkgd,kcd->nkgc", rows, k) * SCALE
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        pos = n_keys - (hi - lo) + np.arange(hi - lo)
        key = np.arange(n_keys)
        valid = key[None, :] <= pos[:, None]
        if window is not None:
            valid &= key[None, :] > pos[:, None] - window
        scores = np.where(valid[:, None, None, :], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[lo:hi] = np.einsum("nkgc,kcd->nkgd", probs, v).reshape(hi - lo, -1, q.shape[-1])
    return out


def ragged_case(seed, seqs, dtype=jnp.float32):
    """seqs: (cached history, new rows) per sequence."""
    rng = np.random.default_rng(seed)
    cache = make_cache(rng, NUM_KV_HEADS, BLOCK_SIZE, 200, dtype)
    seq_lens = np.array([h + n for h, n in seqs], np.int32)
    tables = np.asarray(block_tables(rng, list(seq_lens), WIDTH, cache.num_blocks))
    query_start = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = queries(rng, int(query_start[-1]) + PADDED_ROWS, NUM_KV_HEADS * GROUP, dtype)
    return q, cache, tables, seq_lens, query_start


# (history, new rows): long chunks, a chunk over a long history, decode-like rows between them,
# and a 0-row padding entry.
MIXED = [(0, 263), (3, 1), (600, 9), (0, 0), (150, 8), (37, 129), (639, 1)]


BACKENDS = pytest.mark.parametrize("backend", sorted(PLAIN_JAX))


@BACKENDS
@pytest.mark.parametrize("options", [{}, {"soft_cap": 2.0, "sliding_window": 300}])
def test_prefill_matches_numpy(backend, options):
    q, cache, tables, seq_lens, query_start = ragged_case(0, MIXED)
    got = PLAIN_JAX[backend][1](
        q,
        cache.k,
        cache.v,
        jnp.int32(LAYER),
        jnp.asarray(tables),
        jnp.asarray(seq_lens),
        jnp.asarray(query_start),
        scale=SCALE,
        **options,
    )
    want = numpy_attention(
        q, cache.k, cache.v, tables, seq_lens, query_start, options.get("soft_cap"), options.get("sliding_window")
    )
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert not np.asarray(got[-PADDED_ROWS:]).any(), "padding rows must give zeros"


@BACKENDS
def test_prefill_bf16_matches_numpy(backend):
    q, cache, tables, seq_lens, query_start = ragged_case(1, MIXED[:4], jnp.bfloat16)
    got = PLAIN_JAX[backend][1](
        q,
        cache.k,
        cache.v,
        jnp.int32(LAYER),
        jnp.asarray(tables),
        jnp.asarray(seq_lens),
        jnp.asarray(query_start),
        scale=SCALE,
    )
    assert got.dtype == jnp.bfloat16
    want = numpy_attention(
        q.astype(jnp.float32), cache.k.astype(jnp.float32), cache.v.astype(jnp.float32), tables, seq_lens, query_start
    )
    assert_close(got, want, TOLERANCE[jnp.bfloat16])


@BACKENDS
def test_a_sequence_does_not_see_its_neighbours(backend):
    """The same sequence alone and among others gives the same rows."""
    q, cache, tables, seq_lens, query_start = ragged_case(2, MIXED)
    args = (cache.k, cache.v, jnp.int32(LAYER))
    prefill = PLAIN_JAX[backend][1]
    together = prefill(q, *args, jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(query_start), scale=SCALE)
    s = 5
    lo, hi = query_start[s], query_start[s + 1]
    alone = prefill(
        q[lo:hi],
        *args,
        jnp.asarray(tables[s : s + 1]),
        jnp.asarray(seq_lens[s : s + 1]),
        jnp.asarray([0, hi - lo], jnp.int32),
        scale=SCALE,
    )
    np.testing.assert_allclose(np.asarray(alone), np.asarray(together[lo:hi]), rtol=1e-6, atol=1e-6)


@BACKENDS
@pytest.mark.parametrize("options", [{"sliding_window": 200}, {"soft_cap": 3.0}])
def test_decode_matches_numpy(backend, options):
    lengths = [1, 640, 0, 257, 16, 300]
    q, cache, tables, seq_lens, _ = ragged_case(3, [(n - 1, 1) if n else (0, 0) for n in lengths])
    q = q[: len(lengths)]
    got = PLAIN_JAX[backend][0](
        q, cache.k, cache.v, jnp.int32(LAYER), jnp.asarray(tables), jnp.asarray(seq_lens), scale=SCALE, **options
    )
    starts = np.arange(len(lengths) + 1, dtype=np.int32)
    want = numpy_attention(
        q, cache.k, cache.v, tables, seq_lens, starts, options.get("soft_cap"), options.get("sliding_window")
    )
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert not np.asarray(got[2]).any(), "a padded entry (length 0) must give zeros"


@BACKENDS
def test_decode_window_past_the_first_pages(backend):
    """Every sequence's window starts pages in (paged_jax's loop starts there too)."""
    lengths = [640, 513, 0, 300]
    q, cache, tables, seq_lens, _ = ragged_case(4, [(n - 1, 1) if n else (0, 0) for n in lengths])
    q = q[: len(lengths)]
    got = PLAIN_JAX[backend][0](
        q,
        cache.k,
        cache.v,
        jnp.int32(LAYER),
        jnp.asarray(tables),
        jnp.asarray(seq_lens),
        scale=SCALE,
        sliding_window=70,
    )
    starts = np.arange(len(lengths) + 1, dtype=np.int32)
    want = numpy_attention(q, cache.k, cache.v, tables, seq_lens, starts, window=70)
    assert_close(got, want, TOLERANCE[jnp.float32])
