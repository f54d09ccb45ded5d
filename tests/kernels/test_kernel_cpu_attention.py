"""The C++ kernels of the `cpu` backend against the references, at the shapes they specialize
(head_dim 16..256, query-head groups larger than one register group, block sizes below and
above a 16-key step), bf16 queries (bf16 pairs on a bf16 cache), and what they do with inputs they
cannot serve. Caches of the other
formats (bf16, int8, fp8): test_kernel_kv_dtypes.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import TOLERANCE, assert_close, reference_decode, reference_prefill

from kernels_pallas import cpu_attention

STATIC = ("scale", "soft_cap", "sliding_window")
decode = jax.jit(cpu_attention.decode_attention, static_argnames=STATIC)
prefill = jax.jit(cpu_attention.prefill_attention, static_argnames=STATIC)
SHAPES = pytest.mark.parametrize(
    "kv_heads,group,head_dim,block_size",
    [
        (3, 3, 64, 16),  # the default model
        (2, 1, 32, 8),
        (1, 20, 128, 16),  # more query heads per kv head than one register group holds
        (2, 4, 256, 4),
        (2, 2, 80, 32),  # head_dim 80 (Phi); pages of 32 keys, two key steps each
        (2, 2, 16, 16),  # the tiny test model
    ],
)
OPTIONS = pytest.mark.parametrize("options", [{}, {"soft_cap": 2.0, "sliding_window": 21}])


def case(seed, kv_heads, group, head_dim, block_size, lengths, width=12, num_blocks=40, layers=2):
    rng = np.random.default_rng(seed)
    shape = (layers, kv_heads, num_blocks, block_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    tables = np.stack([rng.permutation(np.arange(1, num_blocks))[:width] for _ in lengths]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((len(lengths), kv_heads * group, head_dim)), jnp.float32)
    return q, k, v, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)


@SHAPES
@OPTIONS
def test_decode_matches_reference(kv_heads, group, head_dim, block_size, options):
    full = 12 * block_size
    q, k, v, tables, lengths = case(
        0, kv_heads, group, head_dim, block_size, [1, block_size, full, 0, full - 3, 2 * block_size + 1]
    )
    scale = head_dim**-0.5
    got = decode(q, k, v, jnp.int32(1), tables, lengths, scale=scale, **options)
    want = reference_decode(q, k, v, jnp.int32(1), tables, lengths, scale=scale, **options)
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert not np.asarray(got[3]).any(), "a padded entry (length 0) must give zeros"


@SHAPES
@OPTIONS
def test_prefill_matches_reference(kv_heads, group, head_dim, block_size, options):
    full = 12 * block_size
    # (history, new rows): a fresh prompt over several 16-row tiles, a chunk starting mid-page,
    # one row, a chunk ending at the table's end, and a padding entry; then padding rows.
    sequences = [(0, 37), (block_size + 3, 18), (5, 1), (full - 20, 20), (0, 0)]
    q, k, v, tables, _ = case(4, kv_heads, group, head_dim, block_size, [h + n for h, n in sequences])
    seq_lens = jnp.asarray([h + n for h, n in sequences], jnp.int32)
    query_start = jnp.asarray(np.cumsum([0] + [n for _, n in sequences]), jnp.int32)
    rows = int(query_start[-1]) + 3
    q = jnp.asarray(np.random.default_rng(5).standard_normal((rows, kv_heads * group, head_dim)), jnp.float32)
    scale = head_dim**-0.5
    got = prefill(q, k, v, jnp.int32(1), tables, seq_lens, query_start, scale=scale, **options)
    want = reference_prefill(q, k, v, jnp.int32(1), tables, seq_lens, query_start, scale=scale, **options)
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert not np.asarray(got[-3:]).any(), "rows past the last chunk must be zeros"


@SHAPES
@OPTIONS
@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_prefill_of_bf16_queries_multiplies_bf16_pairs_within_bf16_tolerance(
    kv_heads, group, head_dim, block_size, options, cache
):
    """A bf16 model's prefill takes its products in bf16 pairs (AVX512-BF16 where present): every
    tile shape, odd key counts (a pair's second key past the block), soft cap and window."""
    full = 12 * block_size
    sequences = [(0, 37), (block_size + 3, 18), (5, 1), (full - 21, 21), (0, 0)]
    q, k, v, tables, _ = case(7, kv_heads, group, head_dim, block_size, [h + n for h, n in sequences])
    store = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[cache]
    k, v = (x.astype(store) for x in (k, v))
    seq_lens = jnp.asarray([h + n for h, n in sequences], jnp.int32)
    query_start = jnp.asarray(np.cumsum([0] + [n for _, n in sequences]), jnp.int32)
    rows = int(query_start[-1])
    q = jnp.asarray(np.random.default_rng(8).standard_normal((rows, kv_heads * group, head_dim)), jnp.bfloat16)
    scale = head_dim**-0.5
    got = prefill(q, k, v, jnp.int32(1), tables, seq_lens, query_start, scale=scale, **options)
    assert got.dtype == jnp.bfloat16
    want = reference_prefill(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        jnp.int32(1),
        tables,
        seq_lens,
        query_start,
        scale=scale,
        **options,
    )
    assert_close(got, want, TOLERANCE[jnp.bfloat16])


@SHAPES
@OPTIONS
def test_decode_of_bf16_queries_on_a_bf16_cache_within_bf16_tolerance(kv_heads, group, head_dim, block_size, options):
    """A bf16 model's decode (bf16 queries, bf16 cache) takes its products in bf16 pairs where the
    head_dim is a multiple of 32 (AVX512-BF16 where present; 16 and 80 stay f32): every query group
    size, odd lengths (a pair's second key past the end), a length in the middle of a pair of pages,
    soft cap and window; a padded entry gives zeros."""
    full = 12 * block_size
    q, k, v, tables, lengths = case(
        9, kv_heads, group, head_dim, block_size, [1, block_size, full, 0, full - 3, 2 * block_size + 1]
    )
    q, k, v = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    scale = head_dim**-0.5
    got = decode(q, k, v, jnp.int32(1), tables, lengths, scale=scale, **options)
    assert got.dtype == jnp.bfloat16
    want = reference_decode(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        jnp.int32(1),
        tables,
        lengths,
        scale=scale,
        **options,
    )
    assert_close(got, want, TOLERANCE[jnp.bfloat16])
    assert not np.asarray(got[3]).any(), "a padded entry (length 0) must give zeros"


def test_bf16_queries_on_an_f32_cache_are_computed_in_f32():
    q, k, v, tables, lengths = case(1, 2, 2, 64, 16, [5, 100])
    got = decode(q.astype(jnp.bfloat16), k, v, jnp.int32(0), tables, lengths, scale=0.125)
    assert got.dtype == jnp.bfloat16
    want = reference_decode(
        q.astype(jnp.bfloat16).astype(jnp.float32), k, v, jnp.int32(0), tables, lengths, scale=0.125
    )
    assert_close(got, want, TOLERANCE[jnp.bfloat16])


def test_rejects_what_it_cannot_serve():
    q, k, v, tables, lengths = case(2, 2, 2, 64, 16, [5, 100])
    with pytest.raises(Exception, match="page out of range"):
        decode(q, k, v, jnp.int32(0), tables.at[1, 0].set(40), lengths, scale=0.125).block_until_ready()
    with pytest.raises(Exception, match="layer out of range"):
        decode(q, k, v, jnp.int32(2), tables, lengths, scale=0.125).block_until_ready()
    q, k, v, tables, lengths = case(3, 1, 1, 40, 16, [5])
    with pytest.raises(ValueError, match="head_dim that is a multiple of 16"):
        decode(q, k, v, jnp.int32(0), tables, lengths, scale=0.125)
    with pytest.raises(ValueError, match="head_dim that is a multiple of 16"):
        prefill(q, k, v, jnp.int32(0), tables, lengths, jnp.asarray([0, 1], jnp.int32), scale=0.125)
    q, k, v, tables, lengths = case(6, 2, 2, 64, 16, [5, 100])
    with pytest.raises(Exception, match="query_start / seq_lens out of range"):  # a chunk longer than its sequence
        prefill(
            q, k, v, jnp.int32(0), tables, lengths, jnp.asarray([0, 6, 7], jnp.int32), scale=0.125
        ).block_until_ready()
