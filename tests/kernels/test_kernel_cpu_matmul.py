"""The cpu layer matmul (`kernels_pallas/cpu_matmul.cc`) against numpy at the shapes it
specializes: every row count of its register tiles, K not a multiple of its 64-row passes, a
last column block narrower than the others, work split over threads or not; what it hands to
XLA's dot (too many rows, N not a multiple of the vector width), and a layer out of range."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import cpu_build, cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler")
layer_matmul = jax.jit(cpu_matmul.layer_matmul)


def check(m: int, k: int, n: int, layer: int = 1, layers: int = 3) -> None:
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((layers, k, n), np.float32)
    got = np.asarray(layer_matmul(x, w, layer))
    want = x.astype(np.float64) @ w[layer].astype(np.float64)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max() * np.sqrt(k))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32])
def test_every_tile_height(m):
    check(m, 576, 576)


@pytest.mark.parametrize("k,n", [(100, 192), (1536, 576), (576, 1536), (64, 8 * 13), (7, 48)])
def test_shapes(k, n):
    if n % cpu_matmul.lanes():
        pytest.skip("N is not a multiple of this machine's vector width")
    for m in (1, 5, 8):
        check(m, k, n)


def test_first_and_last_layer():
    check(3, 576, 192, layer=0)
    check(3, 576, 192, layer=2)


@pytest.mark.parametrize("m,n", [(cpu_matmul.MAX_ROWS + 1, 576), (4, 12), (70, 100)])
def test_what_xla_takes(m, n):
    check(m, 64, n)


def test_layer_out_of_range_is_an_error():
    x, w = jnp.ones((2, 64)), jnp.ones((3, 64, 64))
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(layer_matmul(x, w, 3))


def test_refuses_other_dtypes():
    with pytest.raises(ValueError, match="f32 weights"):
        cpu_matmul.layer_matmul(jnp.ones((2, 64)), jnp.ones((3, 64, 64), jnp.bfloat16), 0)
