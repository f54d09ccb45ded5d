"""Stage `quantized_matmul`: the layers' matmuls on weight-only quantized kernels against bf16, at
the 8B model's shapes (q/o, gate/up and down projections of Llama-3-8B), on the model's own GPU
path: `jaxserve.model.quantized.dequantize` then a bf16 dot with f32 accumulation, jitted, which
XLA fuses so that the codes are read once and the dequantized kernel never goes to memory.

Per (projection, rows): seconds of bf16, int8 (per output channel) and q4 (4 bits, groups of
32), each format's time over bf16's, and its weight bytes per second against the device copy
measured in the same process (decode at few rows is bound by those bytes: int8 reads half of
bf16's, q4 about a third). Each quantized matmul is checked against a bf16 dot of its own
dequantized kernel (the same values, so only the order of the sums differs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import kernel_bench
from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord
from checkpoints.quant_format import QuantFormat
from checkpoints.quantize import quantize_kernel
from jaxserve.model.quantized import dequantize

TOLERANCE = 2e-2  # relative to the output's largest magnitude: bf16 activations and weights


def projections(plan: Plan) -> dict[str, tuple[int, int]]:
    """(K, N) of the 8B shape's distinct layer matmuls (tiny stand-ins in the dry run)."""
    c = plan.models["llama3-8b"]
    return {
        "q_proj": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }


def formats(k: int) -> dict[str, QuantFormat]:
    return {"int8": QuantFormat(8, k), "q4": QuantFormat(4, 32)}


@jax.jit
def _bf16(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def _quantized(fmt: QuantFormat):
    return jax.jit(
        lambda x, arrays: jnp.matmul(x, dequantize(arrays, fmt, jnp.bfloat16), preferred_element_type=jnp.float32)
    )


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    copy_bps = kernel_bench.copy_bandwidth(plan.copy_bytes, jnp.bfloat16, plan.iters)
    record.info(copy_bps=copy_bps, device=jax.devices()[0].device_kind, rows=list(plan.quant_rows))
    for name, (k, n) in projections(plan).items():
        w = kernel_bench.random_normal(1, (k, n), jnp.float32) / np.sqrt(k)
        stored = {kind: quantize_kernel(w, fmt) for kind, fmt in formats(k).items()}
        w16 = w.astype(jnp.bfloat16)
        for rows in plan.quant_rows:
            x = kernel_bench.random_normal(2, (rows, k), jnp.bfloat16)
            row = {"case": f"{name} {k}x{n} rows {rows}", "rows": rows}
            row["bf16_s"] = kernel_bench.time_call(lambda: _bf16(x, w16), plan.iters)
            row["bf16_gbps"] = w16.nbytes / row["bf16_s"] / 1e9
            for kind, fmt in formats(k).items():
                arrays, matmul = stored[kind], _quantized(fmt)
                seconds = kernel_bench.time_call(lambda: matmul(x, arrays), plan.iters)
                nbytes = sum(a.nbytes for a in arrays.values())
                want = _bf16(x, dequantize(arrays, fmt, jnp.bfloat16))
                err = float(jnp.max(jnp.abs(matmul(x, arrays) - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-6))
                row.update(
                    {
                        f"{kind}_s": seconds,
                        f"{kind}_over_bf16": seconds / row["bf16_s"],
                        f"{kind}_gbps": nbytes / seconds / 1e9,
                        f"{kind}_pct_copy": 100 * nbytes / seconds / copy_bps,
                        f"{kind}_err": err,
                    }
                )
                if not err <= TOLERANCE:
                    record.problem(f"{row['case']}: {kind} differs from bf16 on its dequantized kernel by {err:.3g}")
            record.row(row)
