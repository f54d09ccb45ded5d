"""Mixture-of-experts MLP: top-k routing, then the chosen experts' SwiGLU / GeGLU on the tokens
routed to them, as grouped matmuls over the assignments sorted by expert (no expert runs on a
token that did not pick it).

The expert computation (`expert_mlp`) sees the experts of one shard: `first_expert` is the global
index of its first local expert, and assignments to other experts are left out (sorted last and
never computed). Under expert parallelism each device runs it on its own experts and the partial
sums are added across devices (`sharding.experts.shard_experts`); on one device it sees them all.

Grouped matmul: XLA:CPU lowers `jax.lax.ragged_dot` to a dense masked product over every group
(all experts' work for every row), so on CPU the assignments are cut into tiles of rows of one
expert each and a loop multiplies each tile by its expert's weights, skipping the tiles past the
last assignment (`grouped_matmul_tiles`). On GPU and TPU `ragged_dot` has grouped lowerings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from checkpoints.config import ModelConfig
from sharding.experts import shard_experts

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


def grouped_matmul_tiles(xs: jax.Array, w: jax.Array, layer: jax.Array, sizes: jax.Array) -> jax.Array:
    """xs [M, K] (rows sorted by group; group g holds `sizes[g]` rows) times layer `layer` of the
    stacked group weights w [L, G, K, N] -> [M, N] f32; rows past sum(sizes) are zeros.

    Each group's rows are cut into tiles of `tile_rows` rows; tile t multiplies its rows by its
    group's weights (read in place from the stack) and writes only the rows of its group. There
    are at most ceil(M / tile) + min(G, M) tiles (a static bound); a loop runs them and skips
    those past the last group's."""
    w = jnp.asarray(w)
    m, n = xs.shape[0], w.shape[-1]
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
            y = _dot(lax.dynamic_slice_in_dim(xs, row0[i], tile), w[layer, group[i]])
            current = lax.dynamic_slice_in_dim(out, row0[i], tile)
            mine = (jnp.arange(tile) < valid[i])[:, None]
            return lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, current), row0[i], 0)

        return lax.cond(i < tile_ends[-1], compute, lambda out: out, out)

    return lax.fori_loop(0, num_tiles, body, out)[:m]


def grouped_matmul_ragged(xs: jax.Array, w: jax.Array, layer: jax.Array, sizes: jax.Array) -> jax.Array:
    """`grouped_matmul_tiles` through `jax.lax.ragged_dot` (grouped on GPU and TPU)."""
    out = lax.ragged_dot(xs.astype(w.dtype), w[layer], sizes, preferred_element_type=jnp.float32)
    return jnp.where((jnp.arange(xs.shape[0]) < jnp.sum(sizes))[:, None], out, 0.0)


def default_grouped_matmul() -> Callable[..., jax.Array]:
    return grouped_matmul_tiles if jax.default_backend() == "cpu" else grouped_matmul_ragged


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
    t, k = ids.shape
    local_experts = w_gate.shape[1]
    local = ids.reshape(-1) - first_expert
    mine = (local >= 0) & (local < local_experts) & jnp.repeat(real, k)
    key = jnp.where(mine, local, local_experts)  # others sort last, as a group of their own
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros(local_experts + 1, jnp.int32).at[key].add(1)[:local_experts]
    rows = order // k
    xs = x[rows]
    hidden = act(grouped_matmul(xs, w_gate, layer, sizes)) * grouped_matmul(xs, w_up, layer, sizes)
    y = grouped_matmul(hidden, w_down, layer, sizes)
    y = y * jnp.where(mine, weights.reshape(-1), 0.0)[order][:, None]
    return jnp.zeros((t, y.shape[1]), jnp.float32).at[rows].add(y)


def expert_backend(config: ModelConfig, mesh: Mesh | None = None) -> Callable[..., jax.Array]:
    """The model's mixture-of-experts computation, (x, ids, weights, real, w_gate, w_up, w_down,
    layer) -> [T, E] f32: `expert_mlp` with the config's activation and the platform's grouped
    matmul, on all experts (no mesh), or on each device's experts of `mesh` (expert parallelism,
    `sharding.experts.shard_experts`)."""
    fn = functools.partial(expert_mlp, act=activation(config.hidden_act), grouped_matmul=default_grouped_matmul())
    return fn if mesh is None else shard_experts(fn, mesh)
