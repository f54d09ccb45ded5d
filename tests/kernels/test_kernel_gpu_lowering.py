"""Both decode kernels (Triton and Mosaic GPU) and the prefill kernel lower for CUDA on a
machine with no GPU, on every jax we run (0.10 and 0.11); the Triton ones also on int8 and fp8
caches (the Mosaic kernel takes bf16 / f16 caches only: `gpu_select` runs Triton on the others).

`lower(lowering_platforms=("cuda",))` runs each Pallas backend's own lowering, which rejects
what an interpreter accepts but a GPU would not: for Triton non-power-of-two tensors, mixed
dot operand types, primitives without a Triton rule; for Mosaic GPU TMA boxes, WGMMA operand
layouts and swizzles, register layouts of the softmax, barrier use. From jax 0.11 the Triton
lowering asks for the target GPU, so every lowering here runs under an abstract mesh naming
one (Hopper, whose compute capability both kernels target; Triton also for Ampere). PTX
compilation and running are not covered: that needs a GPU (bench.gpu_check). The MLA decode
kernel lowers at DeepSeek-V3's latent (512 + 64 values, in halves of 256 + 32) and a smaller one, and
so does the MLA prefill by decompression (plain XLA) at DeepSeek-V3's shapes.
"""

import contextlib

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import decode, decode_mosaic, kv_quant, mla_decode, prefill
from kernels_pallas.mla_decompressed import mla_decompressed_prefill

S = jax.ShapeDtypeStruct
LAYERS, KV_HEADS, BLOCKS, BLOCK, DIM = 2, 2, 64, 16, 64
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "mosaic_gpu_v2"
HOPPER, AMPERE = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def gpu_target(device_kind: str) -> contextlib.AbstractContextManager:
    """An abstract mesh with one abstract GPU of `device_kind`: the lowering's target."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=132, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def cache(dtype, head_dim=DIM, block=BLOCK):
    """A cache of storage dtype `dtype` (int8 / uint8 (fp8) rows carry their scale: kv_quant)."""
    return S((LAYERS, KV_HEADS, BLOCKS, block, kv_quant.row_width(head_dim, dtype)), dtype)


def lowered_text(fn, *args, device_kind: str = HOPPER) -> str:
    with gpu_target(device_kind):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def decode_args(batch, group, dtype, width=8, head_dim=DIM, block=BLOCK, cache_dtype=None):
    kv = cache(cache_dtype or dtype, head_dim, block)
    return (
        S((batch, KV_HEADS * group, head_dim), dtype),
        kv,
        kv,
        S((), jnp.int32),
        S((batch, width), jnp.int32),
        S((batch,), jnp.int32),
    )


# Caches of int8 and fp8 (uint8) rows with their scales (`--kv-cache-dtype`), bf16 queries.
@pytest.mark.parametrize(
    "group,dtype,options,device_kind,cache_dtype",
    [
        (4, jnp.bfloat16, {}, HOPPER, None),
        (1, jnp.float32, {"num_splits": 2}, HOPPER, None),
        (3, jnp.bfloat16, {"soft_cap": 5.0, "sliding_window": 20, "num_splits": 3}, AMPERE, None),
        (3, jnp.bfloat16, {"num_splits": 2}, HOPPER, jnp.int8),
        (3, jnp.bfloat16, {}, AMPERE, jnp.uint8),
    ],
)
def test_triton_decode_lowers(group, dtype, options, device_kind, cache_dtype):
    def fn(q, k, v, layer, tables, lengths):
        return decode.decode_attention(q, k, v, layer, tables, lengths, scale=0.1, interpret=False, **options)

    args = decode_args(4, group, dtype, cache_dtype=cache_dtype)
    assert TRITON_CALL in lowered_text(fn, *args, device_kind=device_kind)


# The shapes of the models we serve (SmolLM2: 3 query heads per kv head of 64; Llama 3 8B: 4 of
# 128), a one-page step, 8-token blocks, a large group, f16, the flash-decoding split, soft cap
# and sliding window, and head_dim 256 (fewer pipeline stages fit).
@pytest.mark.parametrize(
    "group,dtype,head_dim,block,options",
    [
        (3, jnp.bfloat16, 64, 16, {}),
        (4, jnp.bfloat16, 128, 16, {"num_splits": 4}),
        (8, jnp.float16, 64, 8, {"pages_per_step": 2, "num_stages": 2}),
        (16, jnp.bfloat16, 32, 16, {"pages_per_step": 1, "soft_cap": 5.0, "sliding_window": 20, "num_splits": 3}),
        (1, jnp.bfloat16, 256, 16, {}),
    ],
)
def test_mosaic_decode_lowers(group, dtype, head_dim, block, options):
    def fn(q, k, v, layer, tables, lengths):
        return decode_mosaic.decode_attention(q, k, v, layer, tables, lengths, scale=0.1, interpret=False, **options)

    text = lowered_text(fn, *decode_args(4, group, dtype, width=16, head_dim=head_dim, block=block))
    assert MOSAIC_CALL in text and TRITON_CALL not in text


@pytest.mark.parametrize(
    "group,dtype,options,cache_dtype",
    [
        (8, jnp.bfloat16, {}, None),
        (1, jnp.float32, {"soft_cap": 3.0, "sliding_window": 20}, None),
        (3, jnp.bfloat16, {"block_q": 8}, None),
        (3, jnp.bfloat16, {}, jnp.int8),
        (3, jnp.bfloat16, {}, jnp.uint8),
    ],
)
def test_triton_prefill_lowers(group, dtype, options, cache_dtype):
    tokens, seqs, width = 40, 3, 8

    def fn(q, k, v, layer, tables, seq_lens, query_start):
        return prefill.prefill_attention(
            q, k, v, layer, tables, seq_lens, query_start, scale=0.1, interpret=False, **options
        )

    kv = cache(cache_dtype or dtype)
    text = lowered_text(
        fn,
        S((tokens, KV_HEADS * group, DIM), dtype),
        kv,
        kv,
        S((), jnp.int32),
        S((seqs, width), jnp.int32),
        S((seqs,), jnp.int32),
        S((seqs + 1,), jnp.int32),
    )
    assert TRITON_CALL in text


# Attention sinks (gpt-oss): an [H] input of every kernel; Triton decode with one split (its
# partials merged with the sinks) and with three, Mosaic (at least two splits), Triton prefill.
@pytest.mark.parametrize("kernel,options", [("triton", {}), ("triton", {"num_splits": 3}), ("mosaic", {})])
def test_decode_with_sinks_lowers(kernel, options):
    group = 4
    decode_fn = decode.decode_attention if kernel == "triton" else decode_mosaic.decode_attention

    def fn(q, k, v, layer, tables, lengths, sinks):
        return decode_fn(q, k, v, layer, tables, lengths, scale=0.1, sinks=sinks, interpret=False, **options)

    args = (*decode_args(4, group, jnp.bfloat16, width=16), S((KV_HEADS * group,), jnp.float32))
    assert (TRITON_CALL if kernel == "triton" else MOSAIC_CALL) in lowered_text(fn, *args)


@pytest.mark.parametrize("group,options", [(8, {}), (3, {"sliding_window": 20})])
def test_prefill_with_sinks_lowers(group, options):
    tokens, seqs, width = 40, 3, 8

    def fn(q, k, v, layer, tables, seq_lens, query_start, sinks):
        return prefill.prefill_attention(
            q, k, v, layer, tables, seq_lens, query_start, scale=0.1, sinks=sinks, interpret=False, **options
        )

    kv = cache(jnp.bfloat16)
    text = lowered_text(
        fn,
        S((tokens, KV_HEADS * group, DIM), jnp.bfloat16),
        kv,
        kv,
        S((), jnp.int32),
        S((seqs, width), jnp.int32),
        S((seqs,), jnp.int32),
        S((seqs + 1,), jnp.int32),
        S((KV_HEADS * group,), jnp.float32),
    )
    assert TRITON_CALL in text


def test_unsupported_head_dim_is_a_clear_error_not_a_lowering_crash():
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        lowered_text(
            lambda q, k, v, layer, t, n: decode.decode_attention(q, k, v, layer, t, n, scale=1.0, interpret=False),
            *decode_args(1, 2, jnp.bfloat16, head_dim=80),
        )
    with pytest.raises(ValueError, match="head_dim a multiple of 16"):
        lowered_text(
            lambda q, k, v, layer, t, n: decode_mosaic.decode_attention(
                q, k, v, layer, t, n, scale=1.0, interpret=False
            ),
            *decode_args(1, 2, jnp.bfloat16, head_dim=72),
        )


# DeepSeek-V3's 128 heads over a latent of 512 + 64 in bf16, and a smaller one in f32 with splits.
@pytest.mark.parametrize(
    "heads,latent_dim,rope_dim,dtype,options,device_kind",
    [
        (128, 512, 64, jnp.bfloat16, {}, HOPPER),
        (16, 128, 32, jnp.float32, {"num_splits": 2, "pages_per_step": 1}, AMPERE),
    ],
)
def test_triton_mla_decode_lowers(heads, latent_dim, rope_dim, dtype, options, device_kind):
    def fn(q, k, v, layer, tables, lengths):
        return mla_decode.mla_decode_attention(
            q, k, v, layer, tables, lengths, scale=0.1, latent_dim=latent_dim, interpret=False, **options
        )

    half = S((LAYERS, 1, BLOCKS, BLOCK, (latent_dim + rope_dim) // 2), dtype)
    q = S((4, heads, latent_dim + rope_dim), dtype)
    text = lowered_text(
        fn, q, half, half, S((), jnp.int32), S((4, 8), jnp.int32), S((4,), jnp.int32), device_kind=device_kind
    )
    assert TRITON_CALL in text


def test_mla_prefill_by_decompression_lowers_at_deepseek_v3_shapes():
    def fn(q_nope, q_pe, k, v, layer, tables, lengths, starts, kv_b):
        return mla_decompressed_prefill(q_nope, q_pe, k, v, layer, tables, lengths, starts, kv_b, scale=0.1)

    half = S((LAYERS, 1, BLOCKS, BLOCK, (512 + 64) // 2), jnp.bfloat16)
    text = lowered_text(
        fn,
        S((64, 128, 128), jnp.bfloat16),
        S((64, 128, 64), jnp.bfloat16),
        half,
        half,
        S((), jnp.int32),
        S((2, 8), jnp.int32),
        S((2,), jnp.int32),
        S((3,), jnp.int32),
        S((512, 128, 128 + 128), jnp.bfloat16),
    )
    assert "dot_general" in text
