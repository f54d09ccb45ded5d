"""Stage `correctness`: the Pallas kernels against the pure-JAX references (kernels_pallas/reference.py),
compiled natively on the GPU (interpreted in the dry run), at both models' attention shapes, in
f32 and bf16.

Each case packs the edges a kernel can get wrong into one batch: a two-layer cache read at layer 1,
block tables scattered over the pool, lengths of 1, one block -1, one block, one block +1, the
whole table and random ones, and a padded entry of length 0 (must give zeros); decode also runs
with a forced flash-decoding split count, and ragged prefill mixes a fresh prompt, chunks over a
history starting mid-block and on a block boundary, a one-token chunk, a chunk ending the table,
an empty sequence and padding rows (must give zeros).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import kernel_bench
from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord, describe_error
from bench.kernel_bench import random_normal, scattered_tables
from checkpoints.config import ModelConfig
from kernels_pallas import common, decode, prefill, reference

BLOCK_SIZE = 16
NUM_LAYERS, LAYER = 2, 1
FORCED_SPLITS = 3

_reference_decode = jax.jit(reference.decode_attention, static_argnames=("scale",))
_reference_prefill = jax.jit(reference.prefill_attention, static_argnames=("scale",))


def _cache(seed: int, config: ModelConfig, num_blocks: int, dtype) -> tuple[jax.Array, jax.Array]:
    shape = (NUM_LAYERS, config.num_kv_heads, num_blocks, BLOCK_SIZE, config.head_dim)
    return random_normal(3 * seed, shape, dtype), random_normal(3 * seed + 1, shape, dtype)


def _compare(got: jax.Array, want: jax.Array, zero_rows: np.ndarray, dtype: str) -> dict:
    """Max abs error against the bound, and whether rows that must be zero are."""
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = bool(np.isfinite(got32).all())
    err = float(np.max(np.abs(got32 - want32))) if finite else float("inf")
    bound = kernel_bench.TOLERANCE[dtype] * max(1.0, float(np.max(np.abs(want32))))
    zeros = not got32[zero_rows].any()
    same_dtype = got.dtype == want.dtype
    return {"max_err": err, "bound": bound, "finite": finite, "padding_zero": zeros, "same_dtype": same_dtype,
            "ok": finite and err <= bound and zeros and same_dtype}


def decode_case(config: ModelConfig, dtype: str, pages: int, num_splits: int | None, seed: int) -> dict:
    """One decode batch of the edge lengths; `num_splits` None: the kernel's own choice."""
    rng = np.random.default_rng(seed)
    full = pages * BLOCK_SIZE
    lengths = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, full,
               int(rng.integers(2, full)), int(rng.integers(2, full)), 0]
    k, v = _cache(seed, config, len(lengths) * pages + 1, dtype)
    tables = scattered_tables(rng, len(lengths), pages)
    q = random_normal(3 * seed + 2, (len(lengths), config.num_heads, config.head_dim), dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    scale = config.head_dim ** -0.5
    want = _reference_decode(q, k, v, jnp.int32(LAYER), tables, lens, scale=scale)
    got = decode.decode_attention(q, k, v, jnp.int32(LAYER), tables, lens, scale=scale,
                                  num_splits=num_splits)
    return _compare(got, want, np.asarray(lengths) == 0, dtype)


def prefill_case(config: ModelConfig, dtype: str, pages: int, seed: int) -> dict:
    """One ragged prefill step over the edge (history, chunk) pairs, with padding rows."""
    rng = np.random.default_rng(seed)
    full = pages * BLOCK_SIZE
    half = full // 2
    sequences = [(0, min(37, full)), (19, 18), (2 * BLOCK_SIZE, 1), (half - 7, min(64, half)),
                 (full - 5, 5), (0, 0)]  # (cached history, new chunk)
    chunks = [c for _, c in sequences]
    query_start = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    rows = common.next_power_of_2(int(query_start[-1]) + 8)  # padding rows at the end
    k, v = _cache(seed, config, len(sequences) * pages + 1, dtype)
    tables = scattered_tables(rng, len(sequences), pages)
    q = random_normal(3 * seed + 2, (rows, config.num_heads, config.head_dim), dtype)
    seq_lens = jnp.asarray([h + c for h, c in sequences], jnp.int32)
    starts = jnp.asarray(query_start)
    scale = config.head_dim ** -0.5
    want = _reference_prefill(q, k, v, jnp.int32(LAYER), tables, seq_lens, starts, scale=scale)
    got = prefill.prefill_attention(q, k, v, jnp.int32(LAYER), tables, seq_lens, starts, scale=scale)
    return _compare(got, want, np.arange(rows) >= query_start[-1], dtype)


def _cases(plan: Plan):
    """(model, config, dtype, kernel, variant, fn(seed) -> comparison) for every case."""
    pages = plan.correctness_pages
    for model, dtype in plan.correctness:
        config = plan.models[model]
        yield model, config, dtype, "decode", "default splits", functools.partial(
            decode_case, config, dtype, pages, None)
        yield model, config, dtype, "decode", f"{FORCED_SPLITS} splits", functools.partial(
            decode_case, config, dtype, pages, FORCED_SPLITS)
        yield model, config, dtype, "prefill", "ragged", functools.partial(prefill_case, config, dtype, pages)


def _failure(row: dict) -> str:
    if "error" in row:
        return row["error"]
    if not row["finite"]:
        return "NaN or inf in the output (an element never written?)"
    if not row["padding_zero"]:
        return "padding rows are not zero"
    if not row["same_dtype"]:
        return "the output's dtype differs from the reference's"
    return f"max abs error {row['max_err']:.3g} > {row['bound']:.3g}"


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    record.info(interpret=common.resolve_interpret(None), tolerance=kernel_bench.TOLERANCE,
                pages=plan.correctness_pages)
    for seed, (model, config, dtype, kernel, variant, fn) in enumerate(_cases(plan)):
        row = {"kernel": kernel, "variant": variant, "model": model, "dtype": dtype,
               "shape": f"kvh{config.num_kv_heads} g{config.q_per_kv} d{config.head_dim}"}
        t0 = time.perf_counter()
        try:
            row.update(fn(seed))
        except Exception as e:  # one failing case must not hide the others
            row.update(ok=False, error=describe_error(e))
        row["seconds"] = time.perf_counter() - t0
        record.row(row)
        if not row["ok"]:
            record.problem(f"{kernel} {variant} {model} {dtype}: {_failure(row)}")
