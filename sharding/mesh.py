"""Device meshes with axes ("dp", "pp", "ep", "tp"). One device is a 1x1x1x1 mesh: sharding is never
a separate path. `pp` splits the layers into pipeline stages (`sharding.pipeline`). `ep` splits the
experts of mixture-of-experts layers (expert parallelism); the rest of the model is replicated over
it, so a dense model uses ep = 1.

Tensor parallelism splits attention by heads, so `tp` must divide the query heads. When the
model has fewer kv heads than `tp` (or a count `tp` does not divide), each kv head is repeated
until there are lcm(kv_heads, tp) of them: every shard then owns whole kv heads, and the query
heads on a shard still read the K/V of their own original kv head (see `TensorParallelPlan`).
Since `tp` and `kv_heads` both divide the query heads, so does their lcm: a model that `tp`
divides by query heads can always be served this way.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("dp", "pp", "ep", "tp")


def make_mesh(
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    devices: list | None = None,
    expert_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> Mesh:
    """A ("dp", "pp", "ep", "tp") mesh over the first dp x pp x ep x tp devices (of `devices`,
    default all visible). Neighbouring devices share a stage (tp innermost), so on one host a
    stage's tensor-parallel group is contiguous and stages follow one another."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = (data_parallel_size, pipeline_parallel_size, expert_parallel_size, tensor_parallel_size)
    needed = math.prod(sizes)
    if min(sizes) < 1:
        raise ValueError(
            "tensor_parallel_size, data_parallel_size, pipeline_parallel_size and expert_parallel_size must be >= 1"
        )
    if needed > len(devices):
        ep = f" x ep {expert_parallel_size}" if expert_parallel_size > 1 else ""
        pp = f" x pp {pipeline_parallel_size}" if pipeline_parallel_size > 1 else ""
        raise ValueError(
            f"dp x tp = {data_parallel_size} x {tensor_parallel_size}{pp}{ep} = {needed} devices requested, "
            f"but only {len(devices)} are visible"
        )
    shape = sizes
    return Mesh(np.array(devices[:needed], dtype=object).reshape(shape), AXES)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ("dp", "pp", "ep", "tp") mesh of shape 1 x pp x ep x tp per row of a dp x pp x ep x tp
    mesh: the devices of each data-parallel replica."""
    return [Mesh(mesh.devices[i : i + 1], AXES) for i in range(mesh.shape["dp"])]


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """How a model's heads split over `tp` devices.

    `served_kv_heads` = lcm(kv_heads, tp) kv heads exist on the devices (parameters and cache);
    each original kv head j becomes the `kv_replicas` consecutive heads j*r .. j*r + r - 1. Query
    head h reads served head h // (heads / served_kv_heads) = floor(h*r / group), whose original
    head is floor(h / group): the same one as without replication.
    """

    tp: int
    num_heads: int
    num_kv_heads: int
    served_kv_heads: int

    @property
    def kv_replicas(self) -> int:
        return self.served_kv_heads // self.num_kv_heads


def plan_tensor_parallel(num_heads: int, num_kv_heads: int, tp: int) -> TensorParallelPlan:
    """Check that `tp` can split the model's heads; raise ValueError saying why not."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if num_heads % tp:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's {num_heads} query heads; use one of {divisors}"
        )
    return TensorParallelPlan(tp, num_heads, num_kv_heads, math.lcm(num_kv_heads, tp))
