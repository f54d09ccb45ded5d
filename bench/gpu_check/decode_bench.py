"""One decode case of the GPU check: both decode kernels (Triton, Mosaic GPU), JAX's shipped Pallas
`paged_attention` and, where its gathered copy fits, the pure-JAX reference, on the same inputs.

A row holds, per variant, seconds per call (`<name>_s`) or why it did not run (`<name>_error`),
each kernel's largest difference from the reference (`<kernel>_err`) and from the other kernel
(`mosaic_vs_triton_err`, which also covers the cases too large for the reference), the K/V bytes
one call must read, and per kernel its K/V GB/s, % of the device's copy bandwidth and speedup
over JAX's op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernel_bench import DecodeCase, random_normal, scattered_tables, shipped_k_splits, time_call
from kernels_pallas import decode, decode_mosaic, gpu_select, reference

KERNELS = ("triton", "mosaic")


def mosaic_skip_reason(case: DecodeCase, dtype, interpret: bool) -> str | None:
    """Why the Mosaic kernel cannot run this case here (None: it can)."""
    if interpret and not decode_mosaic.interpret_available():
        return f"not run: jax {jax.__version__} has no public Mosaic GPU interpreter (jax >= 0.11)"
    if not interpret and not gpu_select.mosaic_runs_on(gpu_select.compute_capability()):
        return f"not run: needs a Hopper GPU (compute capability 9.x), this is {gpu_select.compute_capability()}"
    reason = decode_mosaic.unsupported_reason(
        case.num_kv_heads * case.group, case.num_kv_heads, case.head_dim, case.block_size, dtype
    )
    return f"not run: {reason}" if reason else None


def _variants(case: DecodeCase, interpret: bool, with_reference: bool, mosaic_skip: str | None) -> dict[str, Callable]:
    """name -> jitted fn(q, k, v, tables, lengths) over one layer of K/V [KVH, NB, BS, D]."""
    scale = case.head_dim**-0.5
    layer = jnp.int32(0)
    width = -(-case.context // case.block_size)
    splits = shipped_k_splits(width)
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention  # deprecated from jax 0.11

    # k[None]: the stacked [1, KVH, NB, BS, D] view inside jit is a bitcast, not a copy.
    variants = {
        "triton": jax.jit(
            lambda q, k, v, t, n: decode.decode_attention(
                q, k[None], v[None], layer, t, n, scale=scale, interpret=interpret
            )
        ),
        "mosaic": jax.jit(
            lambda q, k, v, t, n: decode_mosaic.decode_attention(
                q, k[None], v[None], layer, t, n, scale=scale, interpret=interpret
            )
        ),
        "shipped": jax.jit(
            lambda q, k, v, t, n: paged_attention(
                (q.astype(jnp.float32) * scale).astype(q.dtype),
                k,
                v,
                t,
                n,
                pages_per_compute_block=min(8, width // splits),
                k_splits=splits,
                interpret=interpret,
            )
        ),
        "reference": jax.jit(
            lambda q, k, v, t, n: reference.decode_attention(q, k[None], v[None], layer, t, n, scale=scale)
        ),
    }
    if mosaic_skip:
        del variants["mosaic"]
    if not with_reference:
        del variants["reference"]
    return variants


def _max_diff(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def bench_decode_case(
    case: DecodeCase, dtype, interpret: bool, iters: int, copy_bps: float, with_reference: bool
) -> dict:
    """Time every variant on one set of inputs; see the module docstring for the row's fields."""
    rng = np.random.default_rng(0)
    width = -(-case.context // case.block_size)
    shape = (case.num_kv_heads, case.batch * width + 1, case.block_size, case.head_dim)
    k, v = random_normal(0, shape, jnp.dtype(dtype)), random_normal(1, shape, jnp.dtype(dtype))
    q = random_normal(2, (case.batch, case.num_kv_heads * case.group, case.head_dim), jnp.dtype(dtype))
    tables = scattered_tables(rng, case.batch, width)
    lengths = jnp.full((case.batch,), case.context, jnp.int32)
    mosaic_skip = mosaic_skip_reason(case, dtype, interpret)
    row: dict = {
        "kind": "decode",
        "case": case.label(),
        **dataclasses.asdict(case),
        "kv_bytes": 2
        * case.batch
        * width
        * case.block_size
        * case.num_kv_heads
        * case.head_dim
        * jnp.dtype(dtype).itemsize,
    }
    if mosaic_skip:
        row["mosaic_s"], row["mosaic_error"] = None, mosaic_skip
    outputs = {}
    for name, fn in _variants(case, interpret, with_reference, mosaic_skip).items():
        try:
            outputs[name] = fn(q, k, v, tables, lengths)
            # Interpreted (the dry run), one repeat: the Mosaic GPU interpreter takes seconds a call.
            row[f"{name}_s"] = time_call(lambda: fn(q, k, v, tables, lengths), iters, repeats=1 if interpret else 3)
        except Exception as e:  # unsupported shape, out of memory: reported, the run goes on
            outputs.pop(name, None)
            row[f"{name}_s"] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    for kernel in KERNELS:
        if kernel in outputs and "reference" in outputs:
            row[f"{kernel}_err"] = _max_diff(outputs[kernel], outputs["reference"])
        if row.get(f"{kernel}_s"):
            row[f"{kernel}_gbps"] = row["kv_bytes"] / row[f"{kernel}_s"] / 1e9
            row[f"{kernel}_pct_copy"] = 100 * row["kv_bytes"] / row[f"{kernel}_s"] / copy_bps
            if row.get("shipped_s"):
                row[f"{kernel}_x_shipped"] = row["shipped_s"] / row[f"{kernel}_s"]
    if "triton" in outputs and "mosaic" in outputs:
        row["mosaic_vs_triton_err"] = _max_diff(outputs["mosaic"], outputs["triton"])
    return row
