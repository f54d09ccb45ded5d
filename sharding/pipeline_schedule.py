"""The GPipe schedule in one SPMD program: micro-batches flow through the stages of a `pp` axis.

Inside a `shard_map` that is manual over `pp` only (tensor parallelism inside a stage stays
automatic), a loop of M + P - 1 ticks runs: at tick t stage s runs its layers on micro-batch
t - s, when there is one, and passes its output to stage s + 1 with `lax.ppermute`
(device to device; across hosts where the mesh spans processes). Stage 0 reads the micro-batches
themselves. A stage with nothing to do at a tick skips its layers (`lax.cond`), so the schedule's
bubble, (P - 1) / (M + P - 1) of the stage-ticks, is idle time, not wasted compute. The last
stage's outputs are summed over `pp` (the others contribute zeros) so that every stage holds them.

The loop also returns what each stage ran at each tick: a [P, M + P - 1] int32 array of
micro-batch indices, -1 where the stage was idle, written inside the branch that ran the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharding.pipeline import PP

# stage(params, state, x, extra) -> (y, state): one stage's layers on one micro-batch x [rows, ...],
# with its own slices of `params` and `state` (split over pp) and the micro-batch's `extra`.
Stage = Callable[[Any, Any, jax.Array, Any], tuple[jax.Array, Any]]


def run_pipeline(
    stage: Stage, mesh: Mesh, params: Any, state: Any, inputs: jax.Array, extras: Any
) -> tuple[jax.Array, Any, jax.Array]:
    """Run `stage` over the `pp` stages of `mesh` on M micro-batches.

    params, state: pytrees whose leaves are split over `pp` on their leading axis (stacked layer
    weights; the KV cache). inputs [M, rows, ...]: the micro-batches stage 0 reads. extras: a
    pytree of [M, ...] leaves, micro-batch m's part given to every stage with it (replicated).
    Returns the last stage's outputs [M, rows, ...] (replicated), the new state, and the
    [P, M + P - 1] schedule of micro-batches each stage ran per tick (-1: idle).
    """
    num_stages = mesh.shape[PP]
    num_micro = inputs.shape[0]
    ticks = num_micro + num_stages - 1
    forward = [(s, s + 1) for s in range(num_stages - 1)]

    def body(params, state, inputs, extras):
        s = lax.axis_index(PP)

        def tick(t, loop):
            received, state, outputs, ran = loop
            m = t - s
            index = jnp.clip(m, 0, num_micro - 1)
            x = jnp.where(s == 0, inputs[index], received)
            extra = jax.tree.map(lambda a: a[index], extras)

            def work(x, state):
                y, state = stage(params, state, x, extra)
                return y, state, m

            def idle(x, state):
                return x, state, jnp.int32(-1)

            y, state, done = lax.cond((m >= 0) & (m < num_micro), work, idle, x, state)
            last = (s == num_stages - 1) & (done >= 0)
            outputs = jnp.where(last, lax.dynamic_update_index_in_dim(outputs, y, index, 0), outputs)
            ran = ran.at[t].set(done)
            return lax.ppermute(y, PP, forward), state, outputs, ran

        init = (jnp.zeros_like(inputs[0]), state, jnp.zeros_like(inputs), jnp.full(ticks, -1, jnp.int32))
        _, state, outputs, ran = lax.fori_loop(0, ticks, tick, init)
        outputs = lax.psum(jnp.where(s == num_stages - 1, outputs, jnp.zeros_like(outputs)), PP)
        return outputs, state, ran[None]

    split = jax.tree.map(lambda _: P(PP), params), jax.tree.map(lambda _: P(PP), state)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(*split, P(), jax.tree.map(lambda _: P(), extras)),
        out_specs=(P(), split[1], P(PP)),
        axis_names={PP},
        check_vma=False,
    )
    return fn(params, state, inputs, extras)
