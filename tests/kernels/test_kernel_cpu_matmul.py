"""The cpu matmuls (`kernels_pallas/cpu_matmul.cc`) against numpy. The layer matmul, on
weights stored in its panels, against the [K, N] layout: every row count of its register tiles
and of the rows left over, more rows than one unit of its work, few rows over many panels (all
of them for each panel), one-row calls over an odd number of panels, K of any size, work split
over threads or not, and its refusals (a layer out of range, other dtypes, weights not in its
panels). The tied head, x @ embedding.T: tiles at the
edges of both, and what it leaves to XLA's dot (more rows, K off its vectors, other dtypes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import cpu_build, cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler")


@pytest.fixture(scope="module")
def matmul():
    return cpu_matmul.kernels()


def check(matmul, m: int, k: int, panels: int, layer: int = 1, layers: int = 3) -> None:
    n = panels * matmul.panel
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((layers, k, n), np.float32)
    got = np.asarray(jax.jit(matmul)(x, cpu_matmul.to_panels(jnp.asarray(w), matmul.panel), layer))
    want = x.astype(np.float64) @ w[layer].astype(np.float64)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max() * np.sqrt(k))


def test_panels_are_the_columns_of_the_weights(matmul):
    p = matmul.panel
    w = np.arange(2 * 3 * 2 * p, dtype=np.float32).reshape(2, 3, 2 * p)
    panels = np.asarray(cpu_matmul.to_panels(jnp.asarray(w), p))
    assert panels.shape == matmul.stored_shape(2, 3, 2 * p) == (2, 2, 3, p)
    np.testing.assert_array_equal(panels[1, 1, 2], w[1, 2, p:])  # layer 1, panel 1, row 2
    assert matmul.takes(3 * p) and not matmul.takes(3 * p + 16)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32, 49, 100])
def test_every_tile_height(matmul, m):
    check(matmul, m, 96, 2)


@pytest.mark.parametrize("k,panels", [(100, 3), (576, 1), (7, 5), (1, 2)])
def test_shapes(matmul, k, panels):
    for m in (1, 5, 8):
        check(matmul, m, k, panels)


def test_work_split_over_threads(matmul):
    check(matmul, 64, 576, 24)  # ~57M multiply-adds: every pool thread takes a part
    check(matmul, 1, 1536, 9)
    check(matmul, 49, 576, 40)  # few rows, many panels: a unit takes all 49 rows of its panels
    check(matmul, 1, 96, 41)  # the same at one row: pairs of panels, then the odd one
    check(matmul, 32, 96, 41)
    check(matmul, 65, 576, 40)  # one row more than that: row blocks again


def test_first_and_last_layer(matmul):
    check(matmul, 3, 64, 2, layer=0)
    check(matmul, 3, 64, 2, layer=2)


def test_layer_out_of_range_is_an_error(matmul):
    x, w = jnp.ones((2, 64)), jnp.ones(matmul.stored_shape(3, 64, matmul.panel))
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(jax.jit(matmul)(x, w, 3))


def test_refuses_other_dtypes_and_layouts(matmul):
    with pytest.raises(ValueError, match="f32 weights"):
        matmul(jnp.ones((2, 64)), jnp.ones(matmul.stored_shape(3, 64, matmul.panel), jnp.bfloat16), 0)
    with pytest.raises(ValueError, match="panels"):
        matmul(jnp.ones((2, 64)), jnp.ones((3, 64, matmul.panel)), 0)


@pytest.mark.parametrize("m", range(1, cpu_matmul.HEAD_MAX_ROWS + 1))
@pytest.mark.parametrize("k,v", [(64, 97), (576, 1000), (16, 5)])
def test_head(matmul, m, k, v):
    rng = np.random.default_rng(m * 31 + k + v)
    x, e = rng.standard_normal((m, k), np.float32), rng.standard_normal((v, k), np.float32)
    assert cpu_matmul.HEAD in jax.jit(matmul.head).lower(x, e).as_text()  # the kernel, not XLA's dot
    got = np.asarray(jax.jit(matmul.head)(x, e))
    want = x.astype(np.float64) @ e.T.astype(np.float64)
    assert got.shape == (m, v) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max() * np.sqrt(k))


@pytest.mark.parametrize("m,k,dtype", [(cpu_matmul.HEAD_MAX_ROWS + 1, 64, np.float32), (3, 40, np.float32),
                                     (1, 64, jnp.bfloat16)])
def test_head_refuses_what_xlas_dot_keeps(matmul, m, k, dtype):
    """More rows than it pays for, K off its vectors, other dtypes: the model keeps XLA's dot."""
    x, e = jnp.ones((m, k), jnp.float32), jnp.ones((7, k), dtype)
    assert not matmul.takes_head(x, e)
    with pytest.raises(ValueError, match="does not take"):
        matmul.head(x, e)
