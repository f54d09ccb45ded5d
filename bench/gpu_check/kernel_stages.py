"""Stages `decode_kernels` and `prefill_kernels` on the plan's grid.

Decode (decode_bench.py): K/V bytes per second of both decode kernels, Triton and Mosaic GPU,
against a device-to-device copy measured in the same process, and against JAX's shipped Pallas
`paged_attention` on the same inputs, at the 8B model's attention shape (8 kv heads of 128, 4
query heads each, bf16, 16-token blocks); then the pick of this GPU generation's default kernel
from that table (decode_pick.py). Prefill (bench/kernel_bench.py): achieved TFLOP/s against a
bf16 matmul measured in the same process.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bench import kernel_bench
from bench.gpu_check.decode_bench import KERNELS, bench_decode_case
from bench.gpu_check.decode_pick import pick_decode_kernel
from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord
from kernels_pallas import common, gpu_select


def _check(row: dict, dtype: str, record: StageRecord, kernels: tuple[str, ...] = ("ours",)) -> None:
    """One of our kernels failing, or differing from the reference (or the two decode kernels
    from each other), fails the stage; a kernel that cannot run here ("not run: ...", the Mosaic
    kernel off Hopper) and JAX's op failing (a shape it does not take, say) are only reported."""
    tolerance = kernel_bench.TOLERANCE[dtype]
    for kernel in kernels:
        error = row.get(f"{kernel}_error", "")
        if error and not error.startswith("not run:"):
            record.problem(f"{row['case']}: {kernel}: {error}")
        elif row.get(f"{kernel}_err", 0.0) > tolerance:
            record.problem(f"{row['case']}: {kernel} differs from the reference by {row[f'{kernel}_err']:.3g}")
    if row.get("mosaic_vs_triton_err", 0.0) > tolerance:
        record.problem(f"{row['case']}: the decode kernels differ by {row['mosaic_vs_triton_err']:.3g}")


def run_decode(plan: Plan, stage: Stage, record: StageRecord) -> None:
    interpret = common.resolve_interpret(None)
    dtype = jnp.dtype(plan.dtype)
    config = plan.models[plan.decode_model]
    copy_bps = kernel_bench.copy_bandwidth(plan.copy_bytes, dtype, plan.iters)
    capability = gpu_select.compute_capability()
    record.info(
        copy_bps=copy_bps,
        interpret=interpret,
        dtype=plan.dtype,
        model_shape=plan.decode_model,
        device=jax.devices()[0].device_kind,
        compute_capability=capability,
        reference_max_tokens=plan.reference_max_tokens,
        shipped_default=gpu_select.decode_kernel_for(capability),
    )
    for batch in plan.decode_batches:
        for context in plan.decode_contexts:
            case = kernel_bench.DecodeCase(batch, context, config.q_per_kv, 16, config.num_kv_heads, config.head_dim)
            row = bench_decode_case(
                case,
                dtype,
                interpret,
                plan.iters,
                copy_bps,
                with_reference=batch * context <= plan.reference_max_tokens,
            )
            record.row(row)
            _check(row, plan.dtype, record, KERNELS)
    record.info(pick=pick_decode_kernel(record.data["rows"], kernel_bench.TOLERANCE[plan.dtype]))


def run_prefill(plan: Plan, stage: Stage, record: StageRecord) -> None:
    interpret = common.resolve_interpret(None)
    dtype = jnp.dtype(plan.dtype)
    config = plan.models[plan.decode_model]
    matmul_flops = kernel_bench.matmul_peak(plan.matmul_n, dtype, plan.iters)
    record.info(
        matmul_flops=matmul_flops,
        matmul_n=plan.matmul_n,
        interpret=interpret,
        dtype=plan.dtype,
        model_shape=plan.decode_model,
        device=jax.devices()[0].device_kind,
    )
    for num_seqs, chunk, history in plan.prefill_cases:
        case = kernel_bench.PrefillCase(
            num_seqs, chunk, history, config.q_per_kv, 16, config.num_kv_heads, config.head_dim
        )
        row = kernel_bench.bench_prefill(case, dtype, interpret, plan.iters)
        if row.get("ours_tflops"):
            row["ours_pct_peak"] = 100 * row["ours_tflops"] * 1e12 / matmul_flops
        record.row(row)
        _check(row, plan.dtype, record)
