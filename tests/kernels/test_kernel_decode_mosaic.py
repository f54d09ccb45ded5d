"""The Mosaic GPU decode kernel equals the pure-JAX reference and JAX's shipped paged_attention.

On a CPU the kernel runs in JAX's Mosaic GPU interpreter, which simulates the warpgroups, SMEM,
TMA copies, barriers and WGMMAs of a Hopper GPU: public from jax 0.11 (`plgpu.InterpretGPUParams`),
so on jax 0.10 these cases skip and the kernel is checked by its lowering
(test_kernel_gpu_lowering.py) and, on a GPU, by bench.gpu_check. The argument checks run everywhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
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

from kernels_pallas import decode_mosaic

WIDTH = 6  # block-table width (pages per sequence)
NUM_KV_HEADS = 2
needs_interpreter = pytest.mark.skipif(
    interpret() and not decode_mosaic.interpret_available(),
    reason=f"jax {jax.__version__} has no public Mosaic GPU interpreter (plgpu.InterpretGPUParams, jax >= 0.11)",
)


def run_both(group, block_size, dtype=jnp.bfloat16, seed=0, width=WIDTH, **options):
    rng = np.random.default_rng(seed)
    cache = make_cache(rng, NUM_KV_HEADS, block_size, 48, dtype)
    lengths = decode_lengths(rng, block_size, width)
    tables = block_tables(rng, lengths, width, cache.num_blocks)
    q = queries(rng, len(lengths), NUM_KV_HEADS * group, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    masking = {k: options[k] for k in ("soft_cap", "sliding_window", "sinks") if k in options}
    want = reference_decode(q, cache.k, cache.v, jnp.int32(LAYER), tables, lengths, scale=SCALE, **masking)
    got = decode_mosaic.decode_attention(
        q, cache.k, cache.v, jnp.int32(LAYER), tables, lengths, scale=SCALE, interpret=interpret(), **options
    )
    assert got.dtype == q.dtype
    return got, want


# GQA ratios from 1 to 8 and block sizes 8-32, in pairs that vary both, and f16.
@needs_interpreter
@pytest.mark.parametrize(
    "group,block_size,dtype",
    [
        (1, 8, jnp.bfloat16),
        (3, 16, jnp.bfloat16),
        (4, 32, jnp.bfloat16),
        (8, 16, jnp.float16),
    ],
)
def test_matches_reference(group, block_size, dtype):
    got, want = run_both(group, block_size, dtype)
    assert_close(got, want, TOLERANCE[jnp.bfloat16])
    assert not np.asarray(got[-1]).any(), "a padded entry (length 0) must give zeros"


@needs_interpreter
@pytest.mark.parametrize(
    "group,block_size,num_splits,pages_per_step,num_stages",
    [
        (4, 8, 3, 2, 2),  # splits of unequal use: some end past a sequence, some hold nothing
        (3, 16, 2, 1, 3),  # one page per step; more steps than slots
        (1, 32, 6, 1, 4),  # one page per split
    ],
)
def test_flash_decoding_splits(group, block_size, num_splits, pages_per_step, num_stages):
    got, want = run_both(
        group, block_size, seed=2, num_splits=num_splits, pages_per_step=pages_per_step, num_stages=num_stages
    )
    assert_close(got, want, TOLERANCE[jnp.bfloat16])


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_soft_cap_and_sliding_window(num_splits):
    """The window skips whole steps before it (fewer pipeline steps than the table holds)."""
    got, want = run_both(
        4, 8, seed=3, width=12, soft_cap=2.0, sliding_window=21, num_splits=num_splits, pages_per_step=2, num_stages=2
    )
    assert_close(got, want, TOLERANCE[jnp.bfloat16])


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_sinks(num_splits):
    """gpt-oss's sinks join the splits' merge (with sinks the kernel runs at least two splits)."""
    sinks = jnp.asarray(np.random.default_rng(5).normal(0.0, 2.0, NUM_KV_HEADS * 4), jnp.float32)
    got, want = run_both(4, 8, seed=5, sinks=sinks, num_splits=num_splits, pages_per_step=2, num_stages=2)
    assert_close(got, want, TOLERANCE[jnp.bfloat16])
    assert not np.asarray(got[-1]).any(), "a padded entry (length 0) must give zeros"


@needs_interpreter
def test_matches_shipped_paged_attention():
    """JAX's op applies no 1/sqrt(d): give it q * scale. It takes one layer [KVH, P, PS, D]."""
    rng = np.random.default_rng(4)
    width, block_size, group = 8, 16, 4
    cache = make_cache(rng, NUM_KV_HEADS, block_size, 48, jnp.bfloat16)
    lengths = decode_lengths(rng, block_size, width)
    tables = block_tables(rng, lengths, width, cache.num_blocks)
    q = queries(rng, len(lengths), NUM_KV_HEADS * group, jnp.bfloat16)
    lengths = jnp.asarray(lengths, jnp.int32)
    ours = decode_mosaic.decode_attention(
        q, cache.k, cache.v, jnp.int32(LAYER), tables, lengths, scale=SCALE, interpret=interpret()
    )
    theirs = shipped_paged_attention(
        (q.astype(jnp.float32) * SCALE).astype(jnp.bfloat16),
        cache.k[LAYER],
        cache.v[LAYER],
        tables,
        lengths,
        block_h=16,
        pages_per_compute_block=2,
        k_splits=2,
        interpret=interpret(),
    )
    assert_close(ours, theirs, TOLERANCE[jnp.bfloat16])


@needs_interpreter
def test_pipeline_has_no_races():
    """The interpreter's race detector (vector clocks over SMEM, TMA and WGMMA accesses) finds no
    access to a slot that its barriers do not order: the memory warpgroup never refills a slot the
    compute warpgroup still reads, and the compute warpgroup never reads one still being filled."""
    races = pytest.importorskip(
        "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call",
        reason="the interpreter's race report is internal to jax",
    )
    if not interpret():
        pytest.skip("the race detector runs in the interpreter only")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        # A shape no other case traces, so the kernel is traced under the detector.
        got, want = run_both(2, 16, seed=5, width=10, num_splits=2, pages_per_step=1, num_stages=2)
    assert_close(got, want, TOLERANCE[jnp.bfloat16])
    assert not races.get_races().races_found


def test_interpreting_needs_jax_0_11():
    if decode_mosaic.interpret_available():
        pytest.skip(f"jax {jax.__version__} has the interpreter")
    rng = np.random.default_rng(0)
    cache = make_cache(rng, 1, 16, 4, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="jax >= 0.11"):
        decode_mosaic.decode_attention(
            queries(rng, 1, 2, jnp.bfloat16),
            cache.k,
            cache.v,
            jnp.int32(0),
            jnp.zeros((1, 1), jnp.int32),
            jnp.ones((1,), jnp.int32),
            scale=1.0,
            interpret=True,
        )


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,options,match",
    [
        (4, 2, 32, 16, jnp.float32, {}, "bf16 or f16 cache"),
        (3, 2, 32, 16, jnp.bfloat16, {}, "do not group"),
        (130, 2, 32, 16, jnp.bfloat16, {}, "at most 64 query heads"),
        (4, 2, 72, 16, jnp.bfloat16, {}, "head_dim a multiple of 16"),
        (4, 2, 32, 12, jnp.bfloat16, {}, "block_size a multiple of 8"),
        (4, 2, 32, 16, jnp.bfloat16, {"pages_per_step": 3}, "power of two"),
        (4, 2, 32, 8, jnp.bfloat16, {"pages_per_step": 1}, "16 to 256 keys"),
        (4, 2, 32, 16, jnp.bfloat16, {"num_stages": 1}, "num_stages must be 2 to 32"),
        (4, 2, 256, 16, jnp.bfloat16, {"pages_per_step": 8, "num_stages": 4}, "bytes of SMEM"),
    ],
)
def test_rejects_what_the_kernel_cannot_take(heads, kv_heads, head_dim, block_size, dtype, options, match):
    """Errors come before any tracing of the kernel, on every jax."""
    q = jnp.zeros((1, heads, head_dim), dtype)
    k = jnp.zeros((1, kv_heads, 4, block_size, head_dim), dtype)
    with pytest.raises(ValueError, match=match):
        decode_mosaic.decode_attention(
            q,
            k,
            k,
            jnp.int32(0),
            jnp.zeros((1, 4), jnp.int32),
            jnp.ones((1,), jnp.int32),
            scale=1.0,
            interpret=False,
            **options,
        )


def test_smem_fitting():
    """Defaults fit the budget: four slots of 64 keys at head_dim 128 (the Llama 3 8B shape); at
    256 fewer keys or slots, never fewer than 2 slots of 16 keys."""
    assert decode_mosaic.fit_to_smem(None, 16, 256, 128, 2, 1, None) == (4, 4)
    pages, stages = decode_mosaic.fit_to_smem(None, 16, 256, 256, 2, 4, None)
    assert decode_mosaic.smem_bytes(256, pages * 16, stages, 2, 4) <= decode_mosaic.SMEM_BUDGET
    assert stages >= 2 and pages * 16 >= 16
    assert decode_mosaic.fit_to_smem(2, 16, 256, 256, 2, 4, 3) == (2, 3), "given values are kept"
