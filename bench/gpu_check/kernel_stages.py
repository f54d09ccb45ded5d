"""Stages `decode_kernels` and `prefill_kernels`: bench/kernel_bench.py's cases on the plan's grid.

Decode: K/V bytes per second of our kernel against a device-to-device copy measured in the same
process, and against JAX's shipped Pallas `paged_attention` on the same inputs, at the 8B model's
attention shape (8 kv heads of 128, 4 query heads each, bf16, 16-token blocks). Prefill: achieved
TFLOP/s against a bf16 matmul measured in the same process.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench import kernel_bench
from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord
from kernels_pallas import common

def _check(row: dict, dtype: str, record: StageRecord) -> None:
    """Our kernel failing, or differing from the reference, fails the stage; JAX's op failing
    (a shape it does not take, say) is only reported."""
    if "ours_error" in row:
        record.problem(f"{row['case']}: {row['ours_error']}")
    elif row.get("ours_err", 0.0) > kernel_bench.TOLERANCE[dtype]:
        record.problem(f"{row['case']}: differs from the reference by {row['ours_err']:.3g}")


def run_decode(plan: Plan, stage: Stage, record: StageRecord) -> None:
    interpret = common.resolve_interpret(None)
    dtype = jnp.dtype(plan.dtype)
    config = plan.models[plan.decode_model]
    copy_bps = kernel_bench.copy_bandwidth(plan.copy_bytes, dtype, plan.iters)
    record.info(copy_bps=copy_bps, interpret=interpret, dtype=plan.dtype, model_shape=plan.decode_model,
                device=jax.devices()[0].device_kind, reference_max_tokens=plan.reference_max_tokens)
    for batch in plan.decode_batches:
        for context in plan.decode_contexts:
            case = kernel_bench.DecodeCase(batch, context, config.q_per_kv, 16, config.num_kv_heads,
                                           config.head_dim)
            row = kernel_bench.bench_decode(case, dtype, interpret, plan.iters, copy_bps,
                                            with_reference=batch * context <= plan.reference_max_tokens)
            record.row(row)
            _check(row, plan.dtype, record)


def run_prefill(plan: Plan, stage: Stage, record: StageRecord) -> None:
    interpret = common.resolve_interpret(None)
    dtype = jnp.dtype(plan.dtype)
    config = plan.models[plan.decode_model]
    matmul_flops = kernel_bench.matmul_peak(plan.matmul_n, dtype, plan.iters)
    record.info(matmul_flops=matmul_flops, matmul_n=plan.matmul_n, interpret=interpret, dtype=plan.dtype,
                model_shape=plan.decode_model, device=jax.devices()[0].device_kind)
    for num_seqs, chunk, history in plan.prefill_cases:
        case = kernel_bench.PrefillCase(num_seqs, chunk, history, config.q_per_kv, 16, config.num_kv_heads,
                                        config.head_dim)
        row = kernel_bench.bench_prefill(case, dtype, interpret, plan.iters)
        if row.get("ours_tflops"):
            row["ours_pct_peak"] = 100 * row["ours_tflops"] * 1e12 / matmul_flops
        record.row(row)
        _check(row, plan.dtype, record)
