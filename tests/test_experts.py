"""The mixture-of-experts block: routing, the grouped matmuls (tiled loop and ragged_dot) and the
expert MLP against plain numpy, including empty experts, padding rows and a shard of the experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.experts import (
    expert_load,
    expert_mlp,
    grouped_matmul_ragged,
    grouped_matmul_tiles,
    route,
    tile_rows,
)


def numpy_grouped(xs, w, layer, sizes):
    out = np.zeros((xs.shape[0], w.shape[-1]), np.float64)
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = xs[start : start + n] @ w[layer, g]
        start += n
    return out


@pytest.mark.parametrize("sizes", [[3, 0, 9, 1], [0, 0, 0, 0], [40, 0, 0, 21], [1, 1, 1, 1], [17, 17, 17, 13]])
@pytest.mark.parametrize("grouped", [grouped_matmul_tiles, grouped_matmul_ragged])
def test_grouped_matmul_multiplies_each_row_by_its_groups_weights(grouped, sizes):
    rng = np.random.default_rng(0)
    rows = 64  # rows past sum(sizes) must come back zero
    xs = rng.standard_normal((rows, 12)).astype(np.float32)
    w = rng.standard_normal((2, 4, 12, 20)).astype(np.float32)
    got = jax.jit(grouped)(xs, w, jnp.int32(1), jnp.asarray(sizes, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), numpy_grouped(xs, w, 1, sizes), rtol=1e-5, atol=1e-5)


def test_tiles_follow_the_rows_per_expert():
    assert tile_rows(16, 8) == 8 and tile_rows(1024, 8) == 128 and tile_rows(300, 4) == 128 and tile_rows(40, 4) == 16


def test_routing_takes_the_top_k_of_the_softmax_renormalised_or_not():
    logits = jnp.asarray([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 4.0]])
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    weights, ids = route(logits, 2, normalize=False)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 2], [2, 3]])
    np.testing.assert_allclose(np.asarray(weights), np.take_along_axis(probs, np.asarray(ids), 1), rtol=1e-6)
    weights, _ = route(logits, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), [1.0, 1.0], rtol=1e-6)
    load = expert_load(ids, jnp.asarray([True, False]), 4)
    np.testing.assert_array_equal(np.asarray(load), [0, 1, 1, 0])


@pytest.mark.parametrize("first_expert, local", [(0, 6), (2, 2), (4, 2)])
def test_expert_mlp_sums_the_chosen_experts_of_the_real_rows(first_expert, local):
    """A shard of `local` experts from `first_expert` adds only its own experts' parts; the
    shards' parts sum to the whole."""
    rng = np.random.default_rng(1)
    t, e, f, experts, k = 9, 8, 6, 6, 2
    x = rng.standard_normal((t, e)).astype(np.float32)
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    real = np.arange(t) < t - 2  # the last two rows are padding
    gate, up = (rng.standard_normal((1, experts, e, f)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((1, experts, f, e)).astype(np.float32)
    mine = slice(first_expert, first_expert + local)
    got = expert_mlp(
        x,
        ids,
        weights,
        real,
        gate[:, mine],
        up[:, mine],
        down[:, mine],
        jnp.int32(0),
        first_expert,
        act=jax.nn.silu,
        grouped_matmul=grouped_matmul_tiles,
    )
    want = np.zeros((t, e))
    for row in range(t):
        for j in range(k):
            ex = ids[row, j]
            if real[row] and first_expert <= ex < first_expert + local:
                h = x[row] @ gate[0, ex]
                want[row] += weights[row, j] * ((h / (1 + np.exp(-h))) * (x[row] @ up[0, ex])) @ down[0, ex]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
