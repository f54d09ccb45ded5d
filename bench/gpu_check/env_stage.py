"""Stage `env`: what the run is on (machine, versions, JAX backend and devices, flags), that the
device computes, and that a jitted chain of decode-kernel calls matches the reference. A GPU run
without a GPU visible to JAX stops here; one whose chain fails with the Triton command-buffer
flag is rerun without it (see __main__.py)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import kernel_bench
from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord
from bench.system_info import system_info
from kernels_pallas import common, decode, reference

CHAIN_CALLS = 4


def _chain(attend, q, k, v, tables, lengths):
    """Decode attention CHAIN_CALLS times, each output (squashed) the next query: one program
    with several kernels and fusions between them, as XLA puts into a command buffer."""
    scale = q.shape[-1] ** -0.5
    for _ in range(CHAIN_CALLS):
        q = 2.0 * jnp.tanh(attend(q, k, v, jnp.int32(0), tables, lengths, scale=scale)) + 0.1
    return q


def kernel_chain_error() -> float:
    """Max |Pallas chain - reference chain| in f32, 4 sequences of 2 kv heads x 4 queries x 64."""
    batch, pages, kv_heads, group, head_dim = 4, 4, 2, 4, 64
    shape = (1, kv_heads, batch * pages + 1, 16, head_dim)
    args = (
        kernel_bench.random_normal(0, (batch, kv_heads * group, head_dim), jnp.float32),
        kernel_bench.random_normal(1, shape, jnp.float32),
        kernel_bench.random_normal(2, shape, jnp.float32),
        kernel_bench.scattered_tables(np.random.default_rng(0), batch, pages),
        jnp.asarray([1, 17, 40, 64], jnp.int32),
    )
    ours = jax.jit(functools.partial(_chain, decode.decode_attention))(*args)
    want = jax.jit(functools.partial(_chain, reference.decode_attention))(*args)
    return float(jnp.max(jnp.abs(ours - want)))


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    record.info(
        system=system_info(include_jax_devices=True),
        jax=jax.__version__,
        backend=jax.default_backend(),
        device_kind=device.device_kind,
        device_count=jax.device_count(),
        device_memory_bytes=stats.get("bytes_limit"),
        pallas_interpret=common.resolve_interpret(None),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        jax_platforms=os.environ.get("JAX_PLATFORMS"),
    )
    total = float(jax.jit(lambda x: jnp.sum(x * 2))(jnp.ones(1 << 20, jnp.float32)))
    if total != 2.0 * (1 << 20):
        record.problem(f"the device computed {total} for a sum of 2 * 2^20 ones")
    if not plan.dry_run and jax.default_backend() != "gpu":
        record.problem(
            f"no GPU visible to JAX (backend {jax.default_backend()!r}, JAX_PLATFORMS="
            f"{os.environ.get('JAX_PLATFORMS')!r}); use --dry-run for the CPU check"
        )
        return
    chain_err = kernel_chain_error()
    record.info(kernel_chain_err=chain_err)
    if not chain_err <= kernel_bench.TOLERANCE["float32"]:
        record.problem(
            f"a jitted chain of {CHAIN_CALLS} decode-kernel calls differs from the reference by {chain_err:.3g}"
        )
