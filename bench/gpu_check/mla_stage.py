"""Stage `mla_decode_kernel`: the MLA decode kernel (kernels_pallas/mla_decode.py) at DeepSeek-V3's
attention shape (128 heads over a latent of 512 + 64 values, 16-token blocks; the dry run: 16
heads, 64 + 32) in the plan's dtype, against the pure-JAX absorbed form (kernels_pallas/
mla_reference.py; a difference past the tolerance fails the stage) and the device copy's bandwidth.

A row: seconds per call of the kernel and of the reference, the kernel's largest difference from
the reference, the latent bytes one call must read (each sequence's latents once: the floor; the
kernel reads them once per block of 16 heads) and the kernel's latent GB/s and % of the copy's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench import kernel_bench
from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord, describe_error
from kernels_pallas import common, mla_decode, mla_reference


@dataclasses.dataclass(frozen=True)
class MlaShape:
    heads: int
    latent_dim: int
    rope_dim: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    block_size: int = 16


DEEPSEEK_V3 = MlaShape(128, 512, 64, batches=(1, 16, 64), contexts=(1024, 4096))
DRY_RUN = MlaShape(16, 64, 32, batches=(2,), contexts=(64,))


def _case(shape: MlaShape, batch: int, context: int, dtype, interpret: bool, iters: int, copy_bps: float) -> dict:
    width = -(-context // shape.block_size)
    half = (shape.latent_dim + shape.rope_dim) // 2
    cache_shape = (1, 1, batch * width + 1, shape.block_size, half)
    k, v = (kernel_bench.random_normal(seed, cache_shape, dtype) for seed in (1, 2))
    q = kernel_bench.random_normal(3, (batch, shape.heads, 2 * half), dtype)
    tables = kernel_bench.scattered_tables(np.random.default_rng(0), batch, width)
    lengths = jnp.full((batch,), context, jnp.int32)
    options = dict(scale=(2 * half) ** -0.5, latent_dim=shape.latent_dim)
    layer = jnp.int32(0)
    kernel = jax.jit(lambda *a: mla_decode.mla_decode_attention(*a, interpret=interpret, **options))
    reference = jax.jit(lambda *a: mla_reference.mla_decode_attention(*a, **options))
    args = (q, k, v, layer, tables, lengths)
    latent_bytes = batch * width * shape.block_size * 2 * half * jnp.dtype(dtype).itemsize
    row: dict = {"case": f"b{batch} ctx{context}", "batch": batch, "context": context, "latent_bytes": latent_bytes}
    try:
        got, want = kernel(*args), reference(*args)
        row["err"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        row["kernel_s"] = kernel_bench.time_call(lambda: kernel(*args), iters)
        row["reference_s"] = kernel_bench.time_call(lambda: reference(*args), iters)
    except Exception as e:  # noqa: BLE001 - recorded as the row's error, the stage goes on
        row["error"] = describe_error(e)
        return row
    row["latent_gbps"] = latent_bytes / row["kernel_s"] / 1e9
    row["pct_copy"] = 100 * latent_bytes / row["kernel_s"] / copy_bps
    return row


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    interpret = common.resolve_interpret(None)
    dtype = jnp.dtype(plan.dtype)
    shape = DRY_RUN if plan.dry_run else DEEPSEEK_V3
    copy_bps = kernel_bench.copy_bandwidth(plan.copy_bytes, dtype, plan.iters)
    record.info(
        copy_bps=copy_bps,
        interpret=interpret,
        dtype=plan.dtype,
        device=jax.devices()[0].device_kind,
        **dataclasses.asdict(shape),
    )
    tolerance = kernel_bench.TOLERANCE[plan.dtype]
    for batch in shape.batches:
        for context in shape.contexts:
            row = _case(shape, batch, context, dtype, interpret, plan.iters, copy_bps)
            record.row(row)
            if "error" in row:
                record.problem(f"{row['case']}: {row['error']}")
            elif row["err"] > tolerance:
                record.problem(f"{row['case']}: the MLA kernel differs from the reference by {row['err']:.3g}")
