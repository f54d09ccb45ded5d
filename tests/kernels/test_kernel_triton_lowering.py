"""The kernels lower to Triton IR for CUDA, checked on a machine with no GPU.

`lower(lowering_platforms=("cuda",))` runs the Pallas Triton lowering itself, which rejects
what the interpreter accepts but a GPU would not (non-power-of-two tensors, mixed dot operand
types, primitives without a Triton rule). PTX compilation is not covered: that needs a GPU.
"""

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import decode, prefill

S = jax.ShapeDtypeStruct
LAYERS, KV_HEADS, BLOCKS, BLOCK, DIM = 2, 2, 64, 16, 64
TRITON_CALL = "__gpu$xla.gpu.triton"


def cache(dtype, head_dim=DIM):
    return S((LAYERS, KV_HEADS, BLOCKS, BLOCK, head_dim), dtype)


def lowered_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("group,dtype,options", [
    (4, jnp.bfloat16, {}),
    (1, jnp.float32, {"num_splits": 2}),
    (3, jnp.bfloat16, {"soft_cap": 5.0, "sliding_window": 20, "num_splits": 3}),
])
def test_decode_lowers_to_triton(group, dtype, options):
    batch, width = 4, 8

    def fn(q, k, v, layer, tables, lengths):
        return decode.decode_attention(q, k, v, layer, tables, lengths, scale=0.1,
                                       interpret=False, **options)

    text = lowered_text(fn, S((batch, KV_HEADS * group, DIM), dtype), cache(dtype), cache(dtype),
                        S((), jnp.int32), S((batch, width), jnp.int32), S((batch,), jnp.int32))
    assert TRITON_CALL in text


@pytest.mark.parametrize("group,dtype,options", [
    (8, jnp.bfloat16, {}),
    (1, jnp.float32, {"soft_cap": 3.0, "sliding_window": 20}),
    (3, jnp.bfloat16, {"block_q": 8}),
])
def test_prefill_lowers_to_triton(group, dtype, options):
    tokens, seqs, width = 40, 3, 8

    def fn(q, k, v, layer, tables, seq_lens, query_start):
        return prefill.prefill_attention(q, k, v, layer, tables, seq_lens, query_start,
                                         scale=0.1, interpret=False, **options)

    text = lowered_text(fn, S((tokens, KV_HEADS * group, DIM), dtype), cache(dtype), cache(dtype),
                        S((), jnp.int32), S((seqs, width), jnp.int32), S((seqs,), jnp.int32),
                        S((seqs + 1,), jnp.int32))
    assert TRITON_CALL in text


def test_unsupported_head_dim_is_a_clear_error_not_a_lowering_crash():
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        lowered_text(
            lambda q, k, v, layer, t, n: decode.decode_attention(q, k, v, layer, t, n, scale=1.0,
                                                                 interpret=False),
            S((1, 4, 80), jnp.bfloat16), cache(jnp.bfloat16, 80), cache(jnp.bfloat16, 80),
            S((), jnp.int32), S((1, 8), jnp.int32), S((1,), jnp.int32))
