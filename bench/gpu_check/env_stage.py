"""Stage `env`: what the run is on (machine, versions, JAX backend and devices, flags), and that
the device computes at all; a GPU run without a GPU visible to JAX stops here."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord
from bench.system_info import system_info
from kernels_pallas import common


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    record.info(
        system=system_info(include_jax_devices=True), jax=jax.__version__, backend=jax.default_backend(),
        device_kind=device.device_kind, device_count=jax.device_count(),
        device_memory_bytes=stats.get("bytes_limit"), pallas_interpret=common.resolve_interpret(None),
        xla_flags=os.environ.get("XLA_FLAGS", ""), jax_platforms=os.environ.get("JAX_PLATFORMS"),
    )
    total = float(jax.jit(lambda x: jnp.sum(x * 2))(jnp.ones(1 << 20, jnp.float32)))
    if total != 2.0 * (1 << 20):
        record.problem(f"the device computed {total} for a sum of 2 * 2^20 ones")
    if not plan.dry_run and jax.default_backend() != "gpu":
        record.problem(f"no GPU visible to JAX (backend {jax.default_backend()!r}, JAX_PLATFORMS="
                       f"{os.environ.get('JAX_PLATFORMS')!r}); use --dry-run for the CPU check")
