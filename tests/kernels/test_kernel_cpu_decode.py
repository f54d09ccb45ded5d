"""The C++ decode kernel of the `cpu` backend against the reference, at the shapes it
specializes (head_dim 32..256, query-head groups larger than one register group), and its
errors for inputs it cannot serve."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import cpu_decode
from paged_cases import TOLERANCE, assert_close, reference_decode

decode = jax.jit(cpu_decode.decode_attention, static_argnames=("scale", "soft_cap", "sliding_window"))


def case(seed, kv_heads, group, head_dim, block_size, lengths, width=12, num_blocks=40, layers=2):
    rng = np.random.default_rng(seed)
    shape = (layers, kv_heads, num_blocks, block_size, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    tables = np.stack([rng.permutation(np.arange(1, num_blocks))[:width] for _ in lengths]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((len(lengths), kv_heads * group, head_dim)), jnp.float32)
    return q, k, v, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size", [
    (3, 3, 64, 16),  # the default model
    (2, 1, 32, 8),
    (1, 20, 128, 16),  # more query heads per kv head than one register group holds
    (2, 4, 256, 4),
    (2, 2, 80, 16),  # head_dim 80 (Phi)
])
@pytest.mark.parametrize("options", [{}, {"soft_cap": 2.0, "sliding_window": 21}])
def test_matches_reference(kv_heads, group, head_dim, block_size, options):
    full = 12 * block_size
    q, k, v, tables, lengths = case(0, kv_heads, group, head_dim, block_size,
                                    [1, block_size, full, 0, full - 3, 2 * block_size + 1])
    scale = head_dim**-0.5
    got = decode(q, k, v, jnp.int32(1), tables, lengths, scale=scale, **options)
    want = reference_decode(q, k, v, jnp.int32(1), tables, lengths, scale=scale, **options)
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert not np.asarray(got[3]).any(), "a padded entry (length 0) must give zeros"


def test_bf16_queries_are_computed_in_f32():
    q, k, v, tables, lengths = case(1, 2, 2, 64, 16, [5, 100])
    got = decode(q.astype(jnp.bfloat16), k, v, jnp.int32(0), tables, lengths, scale=0.125)
    assert got.dtype == jnp.bfloat16
    want = reference_decode(q.astype(jnp.bfloat16).astype(jnp.float32), k, v, jnp.int32(0), tables, lengths, scale=0.125)
    assert_close(got, want, TOLERANCE[jnp.bfloat16])


def test_rejects_what_it_cannot_serve():
    q, k, v, tables, lengths = case(2, 2, 2, 64, 16, [5, 100])
    with pytest.raises(ValueError, match="f32 KV cache"):
        decode(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), jnp.int32(0), tables, lengths, scale=0.125)
    with pytest.raises(Exception, match="page out of range"):
        decode(q, k, v, jnp.int32(0), tables.at[1, 0].set(40), lengths, scale=0.125).block_until_ready()
    with pytest.raises(Exception, match="layer out of range"):
        decode(q, k, v, jnp.int32(2), tables, lengths, scale=0.125).block_until_ready()
    q, k, v, tables, lengths = case(3, 1, 1, 40, 16, [5])
    with pytest.raises(ValueError, match="head_dim that is a multiple of 16"):
        decode(q, k, v, jnp.int32(0), tables, lengths, scale=0.125)
