"""Expert parallelism: a mixture-of-experts MLP under `jax.shard_map` over the mesh's `ep` and `tp` axes.

Each device holds the experts of its `ep` rank (whole experts, `sharding.rules`: the `experts`
axis over `ep`) with their hidden units split over `tp` (the `expert_ffw` axis). Every device
holds every token of the step (activations are replicated between blocks, as tensor parallelism
leaves them), so dispatch needs no communication: a device routes the tokens, keeps the
assignments to its own experts and runs them. Combining is one all-reduce (`psum` over `ep` and
`tp`) of the partial sums: each device's experts' contributions, and each `tp` shard's part of
the down projection. That is the all-to-all exchange's equivalent for replicated activations;
the tokens never move, only the [T, E] partial results.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharding.rules import EP, TP

# The expert computation: (x, ids, weights, real, *expert stacks, layer, first_expert) -> [T, E].
ExpertFn = Callable[..., jax.Array]
GATE_UP = P(None, EP, None, TP)  # [L, X, E, F]
DOWN = P(None, EP, TP, None)  # [L, X, F, E]
GATED_STACKS = (GATE_UP, GATE_UP, DOWN)  # w_gate, w_up, w_down
# gpt-oss: w_gate_up [L, X, E, 2F] (gate and up interleaved, so a contiguous split of 2F keeps each
# unit's pair together), its bias [L, X, 2F], w_down.
CLAMPED_STACKS = (GATE_UP, P(None, EP, TP), DOWN)
# The same with the kernels as MXFP4 blocks [L, X, out, in / 32, 16] and scales [L, X, out, in / 32].
MXFP4_CLAMPED_STACKS = (
    {"blocks": P(None, EP, TP, None, None), "scales": P(None, EP, TP, None)},
    P(None, EP, TP),
    {"blocks": P(None, EP, None, TP, None), "scales": P(None, EP, None, TP)},
)


def plan_expert_parallel(num_experts: int, expert_hidden: int, ep: int, tp: int, hidden_block: int = 1) -> None:
    """Raise ValueError unless `ep` divides the experts and `tp` each expert's hidden units, which
    are stored in blocks of `hidden_block` (32 for MXFP4 experts: a block is never split)."""
    if num_experts % ep:
        raise ValueError(f"expert_parallel_size={ep} does not divide the model's {num_experts} experts")
    if expert_hidden % (tp * hidden_block):
        blocks = f" (MXFP4 blocks of {hidden_block})" if hidden_block > 1 else ""
        raise ValueError(f"tensor_parallel_size={tp} does not divide the experts' {expert_hidden} hidden units{blocks}")


def shard_experts(fn: ExpertFn, mesh: Mesh, stacks: tuple[P, ...] = GATED_STACKS) -> Callable[..., jax.Array]:
    """`fn` run on each device's experts and hidden units, its partial sums added over `ep` and `tp`.

    The returned function takes (x, ids, weights, real, *expert stacks, layer) with the stacked
    expert weights laid out as `sharding.rules` places them (`stacks`: their specs; the first is a
    kernel [L, X, ...]), and returns [T, E] f32, replicated."""

    def local(x, ids, weights, real, *args):
        *weight_stacks, layer = args
        first = lax.axis_index(EP) * jax.tree.leaves(weight_stacks[0])[0].shape[1]
        partial = fn(x, ids, weights, real, *weight_stacks, layer, first)
        return lax.psum(partial, (EP, TP))

    specs = (P(), P(), P(), P(), *stacks, P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
