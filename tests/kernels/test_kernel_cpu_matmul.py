"""The cpu matmuls (`kernels_pallas/cpu_matmul.cc`) against numpy. The layer matmul, on
weights stored in its panels, against the [K, N] layout: every row count of its register tiles
and of the rows left over, more rows than one unit of its work, few rows over many panels (all
of them for each panel), one-row calls over an odd number of panels, K of any size, work split
over threads or not, and its refusals (a layer out of range, other dtypes, weights not in its
panels). The tied head, x @ embedding.T: tiles at the
edges of both, and what it leaves to XLA's dot (more rows, K off its vectors, other dtypes).

bf16 weights (panels of pairs, a bf16 embedding), with f32 or bf16 activations: against the
product of the bf16-rounded operands in f64 (the kernel's exact result but for its f32 sums,
so the f32 tolerance), and against the f32 operands' product within the bound bf16 rounding
allows: each operand is off by at most 2^-9 of itself, so each product by at most ~2^-8 of
|x| |w|, and the sum by at most 2^-8 (|x| @ |w|) (the tests allow 2^-7 of it, half of that for
the accumulation). The same tests run again in a subprocess on kernels built without
AVX512-BF16 (and without AVX-512), the paths of CPUs that lack them, where this one has them."""

import os
import subprocess
import sys

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
    with pytest.raises(ValueError, match="f32 or bf16 weights"):
        matmul(jnp.ones((2, 64)), jnp.ones(matmul.stored_shape(3, 64, matmul.panel), jnp.float16), 0)
    with pytest.raises(ValueError, match="panels"):
        matmul(jnp.ones((2, 64)), jnp.ones((3, 64, matmul.panel)), 0)
    with pytest.raises(ValueError, match="panels"):  # f32 panels' shape, bf16 values
        matmul(jnp.ones((2, 64)), jnp.ones(matmul.stored_shape(3, 64, matmul.panel), jnp.bfloat16), 0)


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


@pytest.mark.parametrize(
    "m,k,dtype",
    [(cpu_matmul.HEAD_MAX_ROWS + 1, 64, np.float32), (3, 40, np.float32), (1, 48, jnp.bfloat16), (1, 64, jnp.float16)],
)
def test_head_refuses_what_xlas_dot_keeps(matmul, m, k, dtype):
    """More rows than it pays for, K off its vectors, other dtypes: the model keeps XLA's dot."""
    x, e = jnp.ones((m, k), jnp.float32), jnp.ones((7, k), dtype)
    assert not matmul.takes_head(x, e)
    with pytest.raises(ValueError, match="does not take"):
        matmul.head(x, e)


def bf16(a: np.ndarray) -> np.ndarray:
    """`a` rounded to bf16 (nearest even), in f64."""
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


def check_bf16_result(got, x, w, k: int) -> None:
    """`got` = x @ w of bf16-rounded operands in f32 sums (w [K, N]); within the bf16 bound of f32's."""
    want = bf16(x) @ bf16(w)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max() * np.sqrt(k))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    bound = 2.0**-7 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    assert np.all(np.abs(got - exact) <= bound)


def check_bf16(matmul, m: int, k: int, panels: int, layer: int = 1, layers: int = 3, x_dtype=np.float32) -> None:
    n = panels * matmul.panel
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x = np.asarray(jnp.asarray(rng.standard_normal((m, k), np.float32), x_dtype).astype(jnp.float32))
    w = rng.standard_normal((layers, k, n), np.float32)
    stored = cpu_matmul.to_panels(jnp.asarray(w, jnp.bfloat16), matmul.panel)
    assert stored.dtype == jnp.bfloat16 and stored.shape == matmul.stored_shape(layers, k, n, jnp.bfloat16)
    fn = jax.jit(matmul)
    assert cpu_matmul.LAYER_BF16 in fn.lower(jnp.asarray(x, x_dtype), stored, layer).as_text()
    check_bf16_result(np.asarray(fn(jnp.asarray(x, x_dtype), stored, layer)), x, w[layer], k)


def test_bf16_panels_are_pairs_of_rows(matmul):
    p = matmul.panel
    w = np.arange(2 * 3 * 2 * p, dtype=np.float32).reshape(2, 3, 2 * p)  # K = 3: padded to 4
    panels = np.asarray(cpu_matmul.to_panels(jnp.asarray(w, jnp.bfloat16), p).astype(jnp.float32))
    assert panels.shape == matmul.stored_shape(2, 3, 2 * p, jnp.bfloat16) == (2, 2, 2, p, 2)
    np.testing.assert_array_equal(panels[1, 1, 0, :, 0], bf16(w[1, 0, p:]))  # layer 1, panel 1, rows 0 and 1
    np.testing.assert_array_equal(panels[1, 1, 0, :, 1], bf16(w[1, 1, p:]))
    np.testing.assert_array_equal(panels[1, 1, 1, :, 0], bf16(w[1, 2, p:]))
    np.testing.assert_array_equal(panels[1, 1, 1, :, 1], 0)  # the odd K's padding


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 32, 49, 100])
def test_bf16_every_tile_height(matmul, m):
    check_bf16(matmul, m, 96, 2)


@pytest.mark.parametrize("k,panels", [(100, 3), (576, 1), (7, 5), (1, 2)])
def test_bf16_shapes(matmul, k, panels):
    for m in (1, 5, 8):
        check_bf16(matmul, m, k, panels)


def test_bf16_work_split_and_layers(matmul):
    check_bf16(matmul, 64, 576, 24)
    check_bf16(matmul, 1, 1536, 9)
    check_bf16(matmul, 49, 576, 40)
    check_bf16(matmul, 1, 96, 41)
    check_bf16(matmul, 65, 576, 40)
    check_bf16(matmul, 3, 64, 2, layer=0)
    check_bf16(matmul, 3, 64, 2, layer=2)


@pytest.mark.parametrize("m,k", [(1, 96), (7, 97), (32, 576)])
def test_bf16_activations(matmul, m, k):
    """bf16 rows are taken as they are (f32 ones are rounded to them in the kernel)."""
    check_bf16(matmul, m, k, 2, x_dtype=jnp.bfloat16)


def test_bf16_rounds_activations_to_nearest_even(matmul):
    """x = 1 + 2^-8 (a tie: to 1.0) and 1 + 3 * 2^-8 (a tie: up to 1 + 2^-6), times weights of 1."""
    p = matmul.panel
    x = jnp.array([[1 + 2.0**-8, 1 + 3 * 2.0**-8]], jnp.float32)
    got = np.asarray(jax.jit(matmul)(x, cpu_matmul.to_panels(jnp.ones((1, 2, p), jnp.bfloat16), p), 0))
    np.testing.assert_array_equal(got, 2 + 2.0**-6)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("k,v", [(64, 97), (576, 1000), (32, 5)])
def test_bf16_head(matmul, m, k, v):
    rng = np.random.default_rng(m * 31 + k + v)
    x, e = rng.standard_normal((m, k), np.float32), rng.standard_normal((v, k), np.float32)
    eb = jnp.asarray(e, jnp.bfloat16)
    assert matmul.takes_head(x, eb)
    assert cpu_matmul.HEAD_BF16 in jax.jit(matmul.head).lower(x, eb).as_text()
    check_bf16_result(np.asarray(jax.jit(matmul.head)(x, eb)), x, e.T, k)
    xb = jnp.asarray(x, jnp.bfloat16)  # bf16 rows: the same result
    np.testing.assert_array_equal(np.asarray(jax.jit(matmul.head)(xb, eb)), np.asarray(jax.jit(matmul.head)(x, eb)))


@pytest.mark.parametrize("dtype,m", [(jnp.float32, 4), (jnp.bfloat16, 9), (jnp.bfloat16, 64)])
def test_head_computes_only_the_live_rows(matmul, dtype, m):
    """A step's padding logits rows (after `live` ones) come back zero; the live rows are the
    rows of a call of `live` rows alone; a count outside [0, M] is refused."""
    rng = np.random.default_rng(m)
    x, e = rng.standard_normal((m, 64), np.float32), jnp.asarray(rng.standard_normal((97, 64)), dtype)
    head = jax.jit(matmul.head)
    for live in (0, 1, m - 1, m):
        got = np.asarray(head(x, e, live))
        np.testing.assert_array_equal(got[live:], 0.0)
        if live:
            np.testing.assert_array_equal(got[:live], np.asarray(head(x[:live], e)))
    for bad in (-1, m + 1):
        with pytest.raises(Exception, match="live rows out of range"):
            head(x, e, bad).block_until_ready()


def test_bf16_head_refuses_k_off_its_vectors(matmul):
    x, e = jnp.ones((2, 48)), jnp.ones((7, 48), jnp.bfloat16)
    assert not matmul.takes_head(x, e)


# The AVX-512 widened path shares the AVX2 path's widening code at a wider vector: it runs in the
# slow tier (each case builds the kernels and reruns this file, ~40 s).
ISA_FLAGS = [
    pytest.param("-mno-avx512bf16", id="avx512-widened", marks=pytest.mark.slow),
    pytest.param("-mno-avx512f", id="avx2"),
]


@pytest.mark.parametrize("flags", ISA_FLAGS)
def test_bf16_paths_of_other_cpus(flags):
    """The bf16 tests on kernels built as for a CPU without AVX512-BF16 (bf16 widened to f32 in
    registers) or without AVX-512 (AVX2 vectors), in a subprocess with those flags."""
    if not cpu_matmul.bf16_dot() and flags == "-mno-avx512bf16":
        pytest.skip("this CPU has no AVX512-BF16: the tests above already ran the widened path")
    env = {**os.environ, "JAXSERVE_CPU_KERNEL_FLAGS": flags}
    check = "from kernels_pallas import cpu_matmul; assert not cpu_matmul.bf16_dot(); print(cpu_matmul.panel_width())"
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if flags == "-mno-avx512f":
        assert done.stdout.split()[-1] == "32"  # 8-float vectors
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "bf16 and not paths_of_other_cpus",
            __file__,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
