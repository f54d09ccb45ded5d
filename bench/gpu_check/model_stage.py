"""Stage `models`: the blocks the model families add to the Llama layer, checked and timed on the device.

- Grouped expert matmuls (mixture of experts): `jax.lax.ragged_dot` (the GPU's grouped matmul)
  and the tiled loop (the CPU's) against a dense reference that runs every expert on every row
  and keeps each row's own, at the MoE model's shapes for a decode-sized and a prefill-sized
  number of routed rows, in f32 and bf16; each implementation's time per call.
- Sliding-window attention: the Pallas decode and prefill kernels against the reference with
  the window model's window shorter than the contexts (sequences inside, at and past it; a
  prefill chunk over a history longer than the window), in f32 and bf16.

The engine runs of these models are the `engine_<model>` stages (bench/gpu_check/engine_stage.py).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import kernel_bench
from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord, describe_error
from bench.gpu_check.shapes import MOE_MODEL, WINDOW_MODEL
from bench.kernel_bench import random_normal, scattered_tables
from checkpoints.config import ModelConfig
from jaxserve.model.experts import grouped_matmul_ragged, grouped_matmul_tiles
from kernels_pallas import decode, prefill, reference

BLOCK_SIZE = 16
DTYPES = ("float32", "bfloat16")


def _error(got: jax.Array, want: jax.Array, dtype: str) -> dict:
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = bool(np.isfinite(got32).all())
    err = float(np.max(np.abs(got32 - want32))) if finite else float("inf")
    bound = kernel_bench.TOLERANCE[dtype] * max(1.0, float(np.max(np.abs(want32))))
    return {"max_err": err, "bound": bound, "ok": finite and err <= bound}


@jax.jit
def _dense_grouped(xs: jax.Array, w: jax.Array, layer: jax.Array, sizes: jax.Array) -> jax.Array:
    """Every group's weights on every row, each row keeping its own group's product (f32)."""
    group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(xs.shape[0]), side="right")
    out = jnp.zeros((xs.shape[0], w.shape[-1]), jnp.float32)
    for g in range(w.shape[1]):
        y = jnp.dot(xs.astype(jnp.float32), w[layer, g].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        out = jnp.where((group == g)[:, None], y, out)
    return out


def grouped_matmul_rows(config: ModelConfig, dtype: str, rows: int, iters: int, seed: int) -> list[dict]:
    """The gate projection of `rows` routed rows at `config`'s expert shapes (two layers stacked)."""
    experts, hidden, ffw = config.num_experts, config.hidden_size, config.moe_intermediate_size
    rng = np.random.default_rng(seed)
    sizes = np.bincount(rng.integers(0, experts, rows - rows // 8), minlength=experts).astype(np.int32)
    xs = random_normal(2 * seed, (rows, hidden), dtype)
    w = random_normal(2 * seed + 1, (2, experts, hidden, ffw), dtype) * hidden**-0.5
    layer, sizes = jnp.int32(1), jnp.asarray(sizes)  # rows past the groups (an eighth) must come back zero
    want = _dense_grouped(xs, w, layer, sizes)
    out = []
    for name, fn in (("ragged_dot", grouped_matmul_ragged), ("tiles", grouped_matmul_tiles)):
        row = {
            "check": "grouped matmul",
            "impl": name,
            "dtype": dtype,
            "rows": rows,
            "shape": f"{experts} experts {hidden}x{ffw}",
        }
        try:
            call = jax.jit(fn)
            row.update(_error(call(xs, w, layer, sizes), want, dtype))
            row["ms"] = 1e3 * kernel_bench.time_call(lambda: call(xs, w, layer, sizes), iters)
        except Exception as e:  # one failing implementation must not hide the other
            row.update(ok=False, error=describe_error(e))
        out.append(row)
    return out


def _cache(seed: int, config: ModelConfig, num_blocks: int, dtype: str) -> tuple[jax.Array, jax.Array]:
    shape = (2, config.num_kv_heads, num_blocks, BLOCK_SIZE, config.head_dim)
    return random_normal(3 * seed, shape, dtype), random_normal(3 * seed + 1, shape, dtype)


def window_decode_row(config: ModelConfig, dtype: str, seed: int) -> dict:
    window = config.sliding_window
    lengths = [window - 1, window, window + 5, 3 * window + 7, 1, 0]
    pages = -(-max(lengths) // BLOCK_SIZE)
    rng = np.random.default_rng(seed)
    k, v = _cache(seed, config, len(lengths) * pages + 1, dtype)
    tables = scattered_tables(rng, len(lengths), pages)
    q = random_normal(3 * seed + 2, (len(lengths), config.num_heads, config.head_dim), dtype)
    args = (q, k, v, jnp.int32(1), tables, jnp.asarray(lengths, jnp.int32))
    scale = config.head_dim**-0.5
    want = reference.decode_attention(*args, scale=scale, sliding_window=window)
    got = decode.decode_attention(*args, scale=scale, sliding_window=window)
    return {
        "check": "window decode",
        "impl": "pallas",
        "dtype": dtype,
        "rows": len(lengths),
        "shape": f"window {window}, lengths {lengths}",
        **_error(got, want, dtype),
    }


def window_prefill_row(config: ModelConfig, dtype: str, seed: int) -> dict:
    window = config.sliding_window
    sequences = [(0, min(window + 9, 64)), (2 * window + 3, 32), (window - 4, 9)]  # (history, chunk)
    pages = -(-max(h + c for h, c in sequences) // BLOCK_SIZE)
    chunks = [c for _, c in sequences]
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(chunks)]), jnp.int32)
    rng = np.random.default_rng(seed)
    k, v = _cache(seed, config, len(sequences) * pages + 1, dtype)
    tables = scattered_tables(rng, len(sequences), pages)
    q = random_normal(3 * seed + 2, (sum(chunks) + 8, config.num_heads, config.head_dim), dtype)
    args = (q, k, v, jnp.int32(1), tables, jnp.asarray([h + c for h, c in sequences], jnp.int32), starts)
    scale = config.head_dim**-0.5
    want = reference.prefill_attention(*args, scale=scale, sliding_window=window)
    got = prefill.prefill_attention(*args, scale=scale, sliding_window=window)
    return {
        "check": "window prefill",
        "impl": "pallas",
        "dtype": dtype,
        "rows": sum(chunks),
        "shape": f"window {window}, (history, chunk) {sequences}",
        **_error(got, want, dtype),
    }


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    moe, window = plan.models[MOE_MODEL], plan.models[WINDOW_MODEL]
    record.info(moe_model=MOE_MODEL, window_model=WINDOW_MODEL, tolerance=kernel_bench.TOLERANCE)
    seed = 0
    for dtype in DTYPES:
        cases = [
            lambda s, rows=rows: grouped_matmul_rows(moe, dtype, rows, plan.iters, s)
            for rows in (2 * plan.workload.batches[-1], 2 * plan.workload.max_num_batched_tokens)
        ]
        cases += [lambda s: [window_decode_row(window, dtype, s)], lambda s: [window_prefill_row(window, dtype, s)]]
        for case in cases:
            seed += 1
            t0 = time.perf_counter()
            try:
                rows = case(seed)
            except Exception as e:  # one failing case must not hide the others
                rows = [{"check": "case", "dtype": dtype, "ok": False, "error": describe_error(e)}]
            for row in rows:
                row["seconds"] = time.perf_counter() - t0
                record.row(row)
                if not row["ok"]:
                    detail = row.get("error") or f"max abs error {row['max_err']:.3g} > {row['bound']:.3g}"
                    record.problem(f"{row['check']} {row.get('impl', '')} {dtype}: {detail}")
