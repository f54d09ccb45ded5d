"""Mixture-of-experts MLP: top-k routing, then the chosen experts' SwiGLU / GeGLU on the tokens
routed to them, as grouped matmuls over the assignments sorted by expert (no expert runs on a
token that did not pick it).

The expert computation (`expert_mlp`) sees the experts of one shard: `first_expert` is the global
index of its first local expert, and assignments to other experts are left out (sorted last and
never computed). Under expert parallelism each device runs it on its own experts and the partial
sums are added across devices (`sharding.experts.shard_experts`); on one device it sees them all.

gpt-oss's experts (`config.swiglu_limit` set) differ in three ways: biases, gate and up units
interleaved in one kernel (one grouped matmul gives both), and a clamped SwiGLU
(`clamped_expert_mlp`); the down projection's bias, a sum over each token's experts, is added by
the MLP block beside the backend's result.

Grouped matmul: XLA:CPU lowers `jax.lax.ragged_dot` to a dense masked product over every group
(all experts' work for every row), so on CPU the assignments are cut into tiles of rows of one
expert each and a loop multiplies each tile by its expert's weights, skipping the tiles past the
last assignment (`grouped_matmul_tiles`). On GPU and TPU `ragged_dot` has grouped lowerings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from checkpoints.config import ModelConfig
from jaxserve.model.expert_kernels import ExpertStack, expert_kernel, layer_kernels, num_experts, out_features
from sharding.experts import CLAMPED_STACKS, GATED_STACKS, MXFP4_CLAMPED_STACKS, shard_experts

Activation = Callable[[jax.Array], jax.Array]


def activation(name: str) -> Activation:
    """The gate activation of a gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return functools.partial(jax.nn.gelu, approximate=True)
    raise ValueError(f"unsupported activation {name!r}")


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Routing weights [T, k] (f32) and expert ids [T, k] from router logits [T, X]: softmax over
    all experts, the top k, renormalised to sum to 1 when `normalize`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def route_grouped(
    logits: jax.Array, correction: jax.Array, k: int, groups: int, top_groups: int, normalize: bool, scale: float
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's routing: weights [T, k] (f32) and expert ids [T, k] from router logits [T, X].

    Sigmoid scores; the choice adds the learned `correction` [X] to them and keeps the experts of
    the `top_groups` best of `groups` contiguous groups (a group scores the sum of its two best);
    the weights are the chosen experts' uncorrected scores, renormalised when `normalize`, times
    `scale` (routed_scaling_factor)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction.astype(jnp.float32)
    t, x = choice.shape
    per_group = choice.reshape(t, groups, x // groups)
    group_scores = jnp.sum(lax.top_k(per_group, 2)[0], axis=-1)  # [T, G]
    kept = jnp.zeros((t, groups), bool).at[jnp.arange(t)[:, None], lax.top_k(group_scores, top_groups)[1]].set(True)
    choice = jnp.where(jnp.repeat(kept, x // groups, axis=1), choice, -jnp.inf)
    ids = lax.top_k(choice, k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, ids.astype(jnp.int32)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's gated activation: with the gate clamped above at `limit` and up to +-`limit`,
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def expert_load(ids: jax.Array, real: jax.Array, num_experts: int) -> jax.Array:
    """Assignments per expert [X] int32 of the real rows (`real` [T]) of a step."""
    return jnp.zeros(num_experts, jnp.int32).at[ids].add(real[:, None].astype(jnp.int32))


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] in w's dtype, accumulated in f32."""
    return lax.dot_general(x.astype(w.dtype), w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: about the rows an expert gets on average, a power of two in [8, 128]."""
    mean = max(1, rows // max(groups, 1))
    return int(min(128, max(8, 1 << (mean - 1).bit_length())))


def grouped_matmul_tiles(xs: jax.Array, w: ExpertStack, layer: jax.Array, sizes: jax.Array) -> jax.Array:
    """xs [M, K] (rows sorted by group; group g holds `sizes[g]` rows) times layer `layer` of the
    stacked group weights w [L, G, K, N] (or their MXFP4 storage: `expert_kernels`) -> [M, N]
    f32; rows past sum(sizes) are zeros.

    Each group's rows are cut into tiles of `tile_rows` rows; tile t multiplies its rows by its
    group's weights (read in place from the stack, or dequantized from MXFP4) and writes only the
    rows of its group. There are at most ceil(M / tile) + min(G, M) tiles (a static bound); a loop
    runs them and skips those past the last group's."""
    m, n = xs.shape[0], out_features(w)
    g = sizes.shape[0]
    tile = tile_rows(m, g)
    num_tiles = -(-m // tile) + min(g, m)
    tiles_per = (sizes + tile - 1) // tile
    ends, tile_ends = jnp.cumsum(sizes), jnp.cumsum(tiles_per)
    starts, tile_starts = ends - sizes, tile_ends - tiles_per
    t = jnp.arange(num_tiles)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right"), g - 1)
    row0 = starts[group] + (t - tile_starts[group]) * tile
    valid = jnp.clip(ends[group] - row0, 0, tile)
    xs = jnp.pad(xs, ((0, tile), (0, 0)))  # a tile never reads or writes past the end
    out = jnp.zeros((m + tile, n), jnp.float32)

    def body(i, out):
        def compute(out):
            y = _dot(lax.dynamic_slice_in_dim(xs, row0[i], tile), expert_kernel(w, layer, group[i], xs.dtype))
            current = lax.dynamic_slice_in_dim(out, row0[i], tile)
            mine = (jnp.arange(tile) < valid[i])[:, None]
            return lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, current), row0[i], 0)

        return lax.cond(i < tile_ends[-1], compute, lambda out: out, out)

    return lax.fori_loop(0, num_tiles, body, out)[:m]


def grouped_matmul_ragged(xs: jax.Array, w: ExpertStack, layer: jax.Array, sizes: jax.Array) -> jax.Array:
    """`grouped_matmul_tiles` through `jax.lax.ragged_dot` (grouped on GPU and TPU)."""
    kernels = layer_kernels(w, layer, xs.dtype)
    out = lax.ragged_dot(xs.astype(kernels.dtype), kernels, sizes, preferred_element_type=jnp.float32)
    return jnp.where((jnp.arange(xs.shape[0]) < jnp.sum(sizes))[:, None], out, 0.0)


def default_grouped_matmul() -> Callable[..., jax.Array]:
    return grouped_matmul_tiles if jax.default_backend() == "cpu" else grouped_matmul_ragged


class Assignments(NamedTuple):
    """A step's (token, expert) assignments to the local experts, sorted by expert: row i of the
    sorted order is token `rows[i]` for local expert `experts[i]` (others and padding sort last,
    with `experts[i]` the last local expert's and weight 0); `sizes` [X] counts each expert's."""

    rows: jax.Array
    experts: jax.Array
    weights: jax.Array
    sizes: jax.Array


def sort_assignments(
    ids: jax.Array, weights: jax.Array, real: jax.Array, local_experts: int, first_expert: jax.Array | int
) -> Assignments:
    """The assignments of routing ids, weights [T, k] and real [T] to experts
    [first_expert, first_expert + local_experts), sorted by expert."""
    k = ids.shape[1]
    local = ids.reshape(-1) - first_expert
    mine = (local >= 0) & (local < local_experts) & jnp.repeat(real, k)
    key = jnp.where(mine, local, local_experts)  # others sort last, as a group of their own
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros(local_experts + 1, jnp.int32).at[key].add(1)[:local_experts]
    experts = jnp.minimum(key[order], local_experts - 1)
    return Assignments(order // k, experts, jnp.where(mine, weights.reshape(-1), 0.0)[order], sizes)


def combine(y: jax.Array, assigned: Assignments, num_tokens: int) -> jax.Array:
    """The experts' outputs y [T * k, E] of the sorted assignments, weighted and summed per token."""
    y = y * assigned.weights[:, None]
    return jnp.zeros((num_tokens, y.shape[1]), jnp.float32).at[assigned.rows].add(y)


def expert_mlp(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    real: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    layer: jax.Array,
    first_expert: jax.Array | int = 0,
    *,
    act: Activation,
    grouped_matmul: Callable[..., jax.Array],
) -> jax.Array:
    """The weighted sum over each token's chosen experts among the local ones -> [T, E] f32.

    x [T, E]; ids, weights [T, k] (routing); real [T] (padding rows are routed nowhere); the
    stacked expert weights w_gate, w_up [L, X, E, F] and w_down [L, X, F, E] of X local experts,
    the first of which is expert `first_expert`; `layer` picks the layer."""
    assigned = sort_assignments(ids, weights, real, w_gate.shape[1], first_expert)
    sizes, xs = assigned.sizes, x[assigned.rows]
    hidden = act(grouped_matmul(xs, w_gate, layer, sizes)) * grouped_matmul(xs, w_up, layer, sizes)
    return combine(grouped_matmul(hidden, w_down, layer, sizes), assigned, x.shape[0])


def clamped_expert_mlp(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    real: jax.Array,
    w_gate_up: ExpertStack,
    b_gate_up: jax.Array,
    w_down: ExpertStack,
    layer: jax.Array,
    first_expert: jax.Array | int = 0,
    *,
    limit: float,
    alpha: float,
    grouped_matmul: Callable[..., jax.Array],
) -> jax.Array:
    """`expert_mlp` of gpt-oss's experts, without the down projection's bias: w_gate_up
    [L, X, E, 2F] holds gate and up interleaved (gate in the even columns) with its bias
    b_gate_up [L, X, 2F], under `clamped_swiglu`; the kernels may be MXFP4 (`expert_kernels`)."""
    assigned = sort_assignments(ids, weights, real, num_experts(w_gate_up), first_expert)
    sizes = assigned.sizes
    gate_up = grouped_matmul(x[assigned.rows], w_gate_up, layer, sizes) + b_gate_up[layer][assigned.experts]
    hidden = clamped_swiglu(gate_up[:, 0::2], gate_up[:, 1::2], limit, alpha)
    return combine(grouped_matmul(hidden, w_down, layer, sizes), assigned, x.shape[0])


def expert_backend(config: ModelConfig, mesh: Mesh | None = None) -> Callable[..., jax.Array]:
    """The model's mixture-of-experts computation, (x, ids, weights, real, *expert stacks, layer)
    -> [T, E] f32 with the platform's grouped matmul: `expert_mlp` with the config's activation
    on (w_gate, w_up, w_down), or `clamped_expert_mlp` on (w_gate_up, b_gate_up, w_down) where
    `swiglu_limit` is set; on all experts (no mesh), or on each device's experts of `mesh` (expert
    parallelism, `sharding.experts.shard_experts`)."""
    grouped = default_grouped_matmul()
    if config.swiglu_limit is None:
        fn = functools.partial(expert_mlp, act=activation(config.hidden_act), grouped_matmul=grouped)
        stacks = GATED_STACKS
    else:
        fn = functools.partial(
            clamped_expert_mlp, limit=config.swiglu_limit, alpha=config.swiglu_alpha, grouped_matmul=grouped
        )
        stacks = MXFP4_CLAMPED_STACKS if config.experts_mxfp4 else CLAMPED_STACKS
    return fn if mesh is None else shard_experts(fn, mesh, stacks)
