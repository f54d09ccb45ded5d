"""Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator, with no
value) in every attention backend: the reference equals a float64 NumPy attention with a sink
column, and the others (`jax`, `cpu`, the Pallas Triton decode with and without flash-decoding
splits, the Pallas prefill, interpreted on CPU) equal the reference, with sliding windows too.
Sinks change the output (so these checks can fail), and a row without keys stays zeros."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import (
    LAYER,
    PLAIN_JAX,
    SCALE,
    TOLERANCE,
    assert_close,
    block_tables,
    decode_lengths,
    interpret,
    make_cache,
    prefill_sequences,
    queries,
)

from kernels_pallas import decode, prefill, reference

NUM_KV_HEADS, GROUP, BLOCK, WIDTH = 2, 3, 8, 6
PADDED_ROWS = 3
OPTIONS = ("scale", "soft_cap", "sliding_window")
reference_decode = jax.jit(reference.decode_attention, static_argnames=OPTIONS)
reference_prefill = jax.jit(reference.prefill_attention, static_argnames=OPTIONS)
PALLAS = {
    "triton": (
        lambda *a, **o: decode.decode_attention(*a, interpret=interpret(), **o),
        lambda *a, **o: prefill.prefill_attention(*a, interpret=interpret(), **o),
    ),
    "triton_splits": (
        lambda *a, **o: decode.decode_attention(*a, interpret=interpret(), num_splits=3, pages_per_step=1, **o),
        None,
    ),
}
BACKENDS = {**{name: fns for name, fns in PLAIN_JAX.items() if name != "reference"}, **PALLAS}


def sinks_of(rng: np.random.Generator) -> jax.Array:
    """Sinks of either sign and about the scores' size, so each one matters."""
    return jnp.asarray(rng.normal(0.0, 2.0, NUM_KV_HEADS * GROUP), jnp.float32)


def decode_case(seed: int):
    rng = np.random.default_rng(seed)
    cache = make_cache(rng, NUM_KV_HEADS, BLOCK, 48, jnp.float32)
    lengths = decode_lengths(rng, BLOCK, WIDTH)
    tables = block_tables(rng, lengths, WIDTH, cache.num_blocks)
    q = queries(rng, len(lengths), NUM_KV_HEADS * GROUP, jnp.float32)
    args = (q, cache.k, cache.v, jnp.int32(LAYER), tables, jnp.asarray(lengths, jnp.int32))
    return args, sinks_of(rng)


def prefill_case(seed: int):
    rng = np.random.default_rng(seed)
    cache = make_cache(rng, NUM_KV_HEADS, BLOCK, 48, jnp.float32)
    seqs = prefill_sequences(rng, BLOCK, WIDTH)
    seq_lens = [h + c for h, c in seqs]
    tables = block_tables(rng, seq_lens, WIDTH, cache.num_blocks)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum([c for _, c in seqs])]), jnp.int32)
    q = queries(rng, int(query_start[-1]) + PADDED_ROWS, NUM_KV_HEADS * GROUP, jnp.float32)
    args = (q, cache.k, cache.v, jnp.int32(LAYER), tables, jnp.asarray(seq_lens, jnp.int32), query_start)
    return args, sinks_of(rng)


def numpy_decode(q, k_cache, v_cache, tables, lengths, sinks, window=None):
    """float64: each sequence's softmax over its keys and its heads' sinks, the sinks dropped after."""
    q, k_cache, v_cache, sinks = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache, sinks))
    out = np.zeros_like(q)
    for b, n in enumerate(np.asarray(lengths)):
        if n == 0:
            continue
        pages = np.asarray(tables)[b, : -(-n // BLOCK)]
        k = k_cache[LAYER][:, pages].reshape(NUM_KV_HEADS, -1, q.shape[-1])[:, :n]
        v = v_cache[LAYER][:, pages].reshape(NUM_KV_HEADS, -1, q.shape[-1])[:, :n]
        scores = np.einsum("kgd,kcd->kgc", q[b].reshape(NUM_KV_HEADS, GROUP, -1), k) * SCALE
        if window is not None:
            scores[..., : max(0, n - window)] = -np.inf
        logits = np.concatenate([scores, sinks.reshape(NUM_KV_HEADS, GROUP, 1)], axis=-1)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[b] = np.einsum("kgc,kcd->kgd", probs[..., :-1], v).reshape(q.shape[1:])
    return out


@pytest.mark.parametrize("window", [None, 11])
def test_reference_decode_matches_numpy(window):
    args, sinks = decode_case(0)
    got = reference_decode(*args, scale=SCALE, sliding_window=window, sinks=sinks)
    q, k, v, _, tables, lengths = args
    assert_close(got, numpy_decode(q, k, v, tables, lengths, sinks, window), TOLERANCE[jnp.float32])
    assert not np.asarray(got[-1]).any(), "a padded entry (length 0) must give zeros"
    plain = reference_decode(*args, scale=SCALE, sliding_window=window)
    assert np.max(np.abs(np.asarray(plain) - np.asarray(got))) > 0.05, "the sinks changed nothing"


def test_reference_prefill_rows_equal_decode_of_each_position():
    """A prefill row at position p sees what a decode of length p + 1 sees: the same sinks."""
    args, sinks = prefill_case(1)
    q, k, v, layer, tables, seq_lens, query_start = args
    got = np.asarray(reference_prefill(*args, scale=SCALE, sinks=sinks))
    for s in range(len(seq_lens)):
        lo, hi = int(query_start[s]), int(query_start[s + 1])
        if hi == lo:
            continue
        lengths = jnp.asarray(int(seq_lens[s]) - (hi - lo) + 1 + np.arange(hi - lo), jnp.int32)
        rows = jnp.repeat(tables[s : s + 1], hi - lo, axis=0)
        want = numpy_decode(q[lo:hi], k, v, rows, lengths, sinks)
        assert_close(got[lo:hi], want, TOLERANCE[jnp.float32])
    assert not got[-PADDED_ROWS:].any(), "padding rows must give zeros"


@pytest.mark.parametrize("backend", sorted(name for name, fns in BACKENDS.items() if fns[0] is not None))
@pytest.mark.parametrize("window", [None, 11])
def test_decode_with_sinks_matches_reference(backend, window):
    args, sinks = decode_case(2)
    want = reference_decode(*args, scale=SCALE, sliding_window=window, sinks=sinks)
    got = BACKENDS[backend][0](*args, scale=SCALE, sliding_window=window, sinks=sinks)
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert not np.asarray(got[-1]).any(), "a padded entry (length 0) must give zeros"


@pytest.mark.parametrize("backend", sorted(name for name, fns in BACKENDS.items() if fns[1] is not None))
@pytest.mark.parametrize("window", [None, 11])
def test_prefill_with_sinks_matches_reference(backend, window):
    args, sinks = prefill_case(3)
    want = reference_prefill(*args, scale=SCALE, sliding_window=window, sinks=sinks)
    got = BACKENDS[backend][1](*args, scale=SCALE, sliding_window=window, sinks=sinks)
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert not np.asarray(got[-PADDED_ROWS:]).any(), "padding rows must give zeros"
