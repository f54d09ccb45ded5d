"""Stage `correctness`: the Pallas kernels against the pure-JAX references (kernels_pallas/reference.py),
compiled natively on the GPU (interpreted in the dry run), at both models' attention shapes, in
f32 and bf16: the Triton decode and prefill kernels, and the Mosaic GPU decode kernel in bf16 (it
takes no f32 cache) where it runs (a Hopper GPU; in the dry run, jax >= 0.11's interpreter).

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
from kernels_pallas import common, decode, decode_mosaic, gpu_select, prefill, reference

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
    return {
        "max_err": err,
        "bound": bound,
        "finite": finite,
        "padding_zero": zeros,
        "same_dtype": same_dtype,
        "ok": finite and err <= bound and zeros and same_dtype,
    }


def decode_case(kernel, config: ModelConfig, dtype: str, pages: int, num_splits: int | None, seed: int) -> dict:
    """One decode batch of the edge lengths through `kernel` (a decode_attention); `num_splits`
    None: the kernel's own choice."""
    rng = np.random.default_rng(seed)
    full = pages * BLOCK_SIZE
    lengths = [
        1,
        BLOCK_SIZE - 1,
        BLOCK_SIZE,
        BLOCK_SIZE + 1,
        full,
        int(rng.integers(2, full)),
        int(rng.integers(2, full)),
        0,
    ]
    k, v = _cache(seed, config, len(lengths) * pages + 1, dtype)
    tables = scattered_tables(rng, len(lengths), pages)
    q = random_normal(3 * seed + 2, (len(lengths), config.num_heads, config.head_dim), dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    scale = config.head_dim**-0.5
    want = _reference_decode(q, k, v, jnp.int32(LAYER), tables, lens, scale=scale)
    got = kernel(q, k, v, jnp.int32(LAYER), tables, lens, scale=scale, num_splits=num_splits)
    return _compare(got, want, np.asarray(lengths) == 0, dtype)


def prefill_case(config: ModelConfig, dtype: str, pages: int, seed: int) -> dict:
    """One ragged prefill step over the edge (history, chunk) pairs, with padding rows."""
    rng = np.random.default_rng(seed)
    full = pages * BLOCK_SIZE
    half = full // 2
    sequences = [
        (0, min(37, full)),
        (19, 18),
        (2 * BLOCK_SIZE, 1),
        (half - 7, min(64, half)),
        (full - 5, 5),
        (0, 0),
    ]  # (cached history, new chunk)
    chunks = [c for _, c in sequences]
    query_start = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    rows = common.next_power_of_2(int(query_start[-1]) + 8)  # padding rows at the end
    k, v = _cache(seed, config, len(sequences) * pages + 1, dtype)
    tables = scattered_tables(rng, len(sequences), pages)
    q = random_normal(3 * seed + 2, (rows, config.num_heads, config.head_dim), dtype)
    seq_lens = jnp.asarray([h + c for h, c in sequences], jnp.int32)
    starts = jnp.asarray(query_start)
    scale = config.head_dim**-0.5
    want = _reference_prefill(q, k, v, jnp.int32(LAYER), tables, seq_lens, starts, scale=scale)
    got = prefill.prefill_attention(q, k, v, jnp.int32(LAYER), tables, seq_lens, starts, scale=scale)
    return _compare(got, want, np.arange(rows) >= query_start[-1], dtype)


def mosaic_skip_reason() -> str | None:
    """Why the Mosaic GPU decode kernel cannot run here (None: it can)."""
    if common.resolve_interpret(None):
        if not decode_mosaic.interpret_available():
            return f"jax {jax.__version__} has no public Mosaic GPU interpreter (jax >= 0.11)"
        return None
    capability = gpu_select.compute_capability()
    return None if gpu_select.mosaic_runs_on(capability) else f"needs Hopper (9.x), this is {capability}"


def _cases(plan: Plan, with_mosaic: bool):
    """(model, config, dtype, kernel, variant, fn(seed) -> comparison) for every case."""
    pages = plan.correctness_pages
    for model, dtype in plan.correctness:
        config = plan.models[model]
        kernels = [("decode", decode.decode_attention)]
        if (
            with_mosaic
            and decode_mosaic.unsupported_reason(
                config.num_heads, config.num_kv_heads, config.head_dim, BLOCK_SIZE, jnp.dtype(dtype)
            )
            is None
        ):
            kernels.append(("decode_mosaic", decode_mosaic.decode_attention))
        for name, kernel in kernels:
            yield (
                model,
                config,
                dtype,
                name,
                "default splits",
                functools.partial(decode_case, kernel, config, dtype, pages, None),
            )
            yield (
                model,
                config,
                dtype,
                name,
                f"{FORCED_SPLITS} splits",
                functools.partial(decode_case, kernel, config, dtype, pages, FORCED_SPLITS),
            )
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
    mosaic_skip = mosaic_skip_reason()
    record.info(
        interpret=common.resolve_interpret(None),
        tolerance=kernel_bench.TOLERANCE,
        pages=plan.correctness_pages,
        mosaic="runs" if mosaic_skip is None else f"not run: {mosaic_skip}",
    )
    for seed, (model, config, dtype, kernel, variant, fn) in enumerate(_cases(plan, mosaic_skip is None)):
        row = {
            "kernel": kernel,
            "variant": variant,
            "model": model,
            "dtype": dtype,
            "shape": f"kvh{config.num_kv_heads} g{config.q_per_kv} d{config.head_dim}",
        }
        t0 = time.perf_counter()
        try:
            row.update(fn(seed))
        except Exception as e:  # one failing case must not hide the others
            row.update(ok=False, error=describe_error(e))
        row["seconds"] = time.perf_counter() - t0
        record.row(row)
        if not row["ok"]:
            record.problem(f"{kernel} {variant} {model} {dtype}: {_failure(row)}")
