"""Paged attention for XLA:CPU as C++ kernels behind the XLA FFI (`cpu_attention.cc`).

Why: on XLA:CPU, paged attention in plain JAX (`paged_jax`) gathers each group's K/V pages
into a new buffer, then runs small batched matmuls and softmax passes one loop step at a
time, mostly on one thread: a decode spends about 0.25 ms per 8 rows x 128 keys, half a
batch-8 decode step, where its K/V bytes take a tenth of that at memory bandwidth; a prefill
chunk of 512 rows over a few hundred tokens of history spends ~40% of its step there. The
kernels read K/V rows in place from the cache pages and split their work over threads:
decode, each (sequence, kv head) reads its keys and values once for all its query heads, a
register of keys at a time; prefill, tiles of 16 (row, head) queries (32 with AVX-512) walk the
keys 64 at a time with an online softmax, as two register-tiled products (S^T = K Q^T, then
O^T += V^T P^T). Vectors are the machine's register width.

They read a cache of every format of `kv_quant` (f32, bf16 bits, int8 or fp8 rows with their
scales; `cpu_kv_rows.h`) in place, widening each row to f32 in registers (prefill of bf16 queries:
products of bf16 pairs, AVX512-BF16's dot products), and take a head_dim that is a multiple of 16
up to 256. `cpu_build` compiles the source on first use. Attention sinks (gpt-oss) go in as a
logit per query head; without them every head's is -1e30, whose term in the denominator is 0.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import common, cpu_build

DECODE_TARGET, PREFILL_TARGET = "jaxserve_paged_decode", "jaxserve_paged_prefill"
SOURCE = Path(__file__).with_name("cpu_attention.cc")


def register() -> None:
    """Builds the kernels if this machine has no copy yet, then registers them with XLA (once)."""
    cpu_build.register(SOURCE, {DECODE_TARGET: "JaxservePagedDecode", PREFILL_TARGET: "JaxservePagedPrefill"})


def _call(
    target: str,
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    int_args: tuple[jax.Array, ...],
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    sinks: jax.Array | None,
    **attributes: np.int32,
) -> jax.Array:
    """One kernel call: f32 q and out (q cast back to its dtype), the caches as stored, `int_args`
    as int32, then the sinks [H] f32 (`common.MASKED` where none)."""
    if q.shape[-1] % 16 or q.shape[-1] > 256:
        raise ValueError(
            f"the cpu attention kernels need a head_dim that is a multiple of 16, at most 256, "
            f"not {q.shape[-1]} (use --attention-backend jax)"
        )
    register()
    if sinks is None:
        sinks = jnp.full(q.shape[1:2], common.MASKED, jnp.float32)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32).reshape(()),
        *(a.astype(jnp.int32) for a in int_args),
        sinks.astype(jnp.float32),
        scale=np.float32(scale),
        soft_cap=np.float32(soft_cap or 0.0),
        window=np.int32(sliding_window or 0),
        **attributes,
    )
    return out.astype(q.dtype)


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [B, H, D] -> [B, H, D]; sequence b attends to its first `lengths[b]` cached tokens
    (the contract of `reference.decode_attention`). bf16 queries on a bf16 cache (a bf16 model's)
    take their products in bf16 pairs where the CPU has AVX512-BF16, as prefill's; any other q is
    computed in f32."""
    return _call(
        DECODE_TARGET,
        q,
        k_cache,
        v_cache,
        layer,
        (block_tables, lengths),
        scale,
        soft_cap,
        sliding_window,
        sinks,
        bf16_products=np.int32(q.dtype == jnp.bfloat16),
    )


def prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [T, H, D] (ragged rows of S sequences) -> [T, H, D], causal over each sequence's
    history (the contract of `reference.prefill_attention`); zeros at rows past the last chunk.
    bf16 queries (bf16 activations) take their products in bf16 pairs where the CPU has AVX512-BF16
    (the softmax weights rounded to bf16; `cpu_attention.cc`)."""
    return _call(
        PREFILL_TARGET,
        q,
        k_cache,
        v_cache,
        layer,
        (block_tables, seq_lens, query_start),
        scale,
        soft_cap,
        sliding_window,
        sinks,
        bf16_products=np.int32(q.dtype == jnp.bfloat16),
    )
