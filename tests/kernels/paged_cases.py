"""Random paged-attention inputs shared by the kernel tests.

Caches hold several layers (the kernels must read `layer`, not layer 0), block tables are
scattered over the pool and filled past each sequence's used pages with other live blocks
(the kernels must ignore them), and padded batch entries point at block 0 with length 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import common, cpu_attention, paged_jax, reference

NUM_LAYERS = 3
LAYER = 2
HEAD_DIM = 32  # a power of two >= 16, so the same cases run natively on a GPU
SCALE = HEAD_DIM**-0.5
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


# Jitted once per shape: run eagerly, the references compile op by op (several times slower).
reference_decode = jax.jit(reference.decode_attention, static_argnames=("scale", "soft_cap", "sliding_window"))
reference_prefill = jax.jit(reference.prefill_attention, static_argnames=("scale", "soft_cap", "sliding_window"))
# The plain-JAX backends by name: (decode, prefill), each jitted once per shape.
PLAIN_JAX = {
    "reference": (reference_decode, reference_prefill),
    "jax": (
        jax.jit(paged_jax.decode_attention, static_argnames=("scale", "soft_cap", "sliding_window")),
        jax.jit(paged_jax.prefill_attention, static_argnames=("scale", "soft_cap", "sliding_window")),
    ),
    "cpu": (
        jax.jit(cpu_attention.decode_attention, static_argnames=("scale", "soft_cap", "sliding_window")),
        jax.jit(cpu_attention.prefill_attention, static_argnames=("scale", "soft_cap", "sliding_window")),
    ),
}


def interpret() -> bool:
    """Interpret on CPU; on a GPU as $JAXSERVE_PALLAS_INTERPRET says (0 = native kernels)."""
    return common.resolve_interpret(None)


def assert_close(got: jax.Array, want: jax.Array, tol: float) -> None:
    """Max abs error within tol relative to the output's scale; NaN (an unwritten element) fails."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape
    assert np.isfinite(got).all(), "kernel output has NaN/inf (an element never written?)"
    err = np.max(np.abs(got - want)) if got.size else 0.0
    bound = tol * max(1.0, float(np.max(np.abs(want))))
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


@dataclasses.dataclass
class Cache:
    k: jax.Array  # [L, KVH, NB, BS, D]
    v: jax.Array
    num_blocks: int
    block_size: int


def make_cache(rng: np.random.Generator, num_kv_heads: int, block_size: int, num_blocks: int, dtype) -> Cache:
    shape = (NUM_LAYERS, num_kv_heads, num_blocks, block_size, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    return Cache(k, v, num_blocks, block_size)


def block_tables(rng: np.random.Generator, seq_lens: list[int], width: int, num_blocks: int) -> jax.Array:
    """Each sequence gets distinct blocks scattered over 1..num_blocks-1; length 0 -> all zeros."""
    table = np.zeros((len(seq_lens), width), np.int32)
    for row, n in enumerate(seq_lens):
        if n > 0:
            table[row] = rng.permutation(np.arange(1, num_blocks))[:width]
    return jnp.asarray(table)


def decode_lengths(rng: np.random.Generator, block_size: int, width: int) -> list[int]:
    """1, exact block multiples, the full table, two random lengths, and a padded entry (0)."""
    full = width * block_size
    return [1, block_size, full, int(rng.integers(2, full)), int(rng.integers(2, full)), 2 * block_size, 0]


def prefill_sequences(rng: np.random.Generator, block_size: int, width: int) -> list[tuple[int, int]]:
    """(cached history, new chunk) per sequence: a fresh prompt, chunks starting mid-block and
    on a block boundary, a one-token chunk, a chunk over a long history, and a padding entry."""
    full = width * block_size
    return [
        (0, int(rng.integers(1, 2 * block_size))),
        (block_size + 3, block_size + 2),
        (2 * block_size, 1),
        (int(rng.integers(1, full // 2)), int(rng.integers(1, 12))),
        (full - 5, 5),
        (0, 0),
    ]


def queries(rng: np.random.Generator, rows: int, num_heads: int, dtype) -> jax.Array:
    return jnp.asarray(rng.standard_normal((rows, num_heads, HEAD_DIM)), jnp.float32).astype(dtype)
