"""The quantized layer matmuls (`kernels_pallas/cpu_qmatmul.cc`) against a numpy reference: the
kernel quantized (`checkpoints.quantize.quantize_kernel`), dequantized in numpy from its own codes
and scales, and multiplied in f64. The kernel computes exactly those dequantized weights' products
but for its f32 rounding (the dequantized weight, and the sums), so the tolerance is f32's.

In a bf16 model (`dtype` bf16) a call of many rows (`cpu_qmatmul.panel_rows`) multiplies bf16
values (on f32 tiles; on AMD's CPUs on the dot-product tiles, which a slow test builds here): its
reference rounds the f32 dequantized weights and x to bf16 first (what the kernel's products are,
to f32's tolerance), and it stays within the bound bf16 rounding of both allows of the exact
product (2^-8 of the sum of |x| |w| per output, and f32's summation).

Int8 per channel and in groups of 32 (GGUF Q8_0's), 4 bits in groups of 32: every tile height and
the rows left over, many rows (each panel dequantized once into a buffer), one-row calls over an
odd number of panels, a layer of the stack, and its refusals. The quantizer itself: each weight
within half a step of its group's grid. The same tests run again in a subprocess on kernels built
without AVX-512 (AVX2 vectors, F16C scales; marked slow)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.quant_format import CODES, MIN, SCALE, QuantFormat
from checkpoints.quantize import quantize_kernel
from kernels_pallas import cpu_build, cpu_matmul, cpu_qmatmul
from kernels_pallas.cpu_matmul import to_panels

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler")

FORMATS = {
    "int8": lambda k: QuantFormat(8, k),
    "int8/32": lambda k: QuantFormat(8, 32),
    "q4": lambda k: QuantFormat(4, 32),
}


def reference_dequantize(arrays: dict, fmt: QuantFormat) -> np.ndarray:
    """The kernel [.., K, N] the arrays store, in f64: code * scale (+ min), per group of K."""
    codes = np.asarray(arrays[CODES])
    if fmt.bits == 4:
        codes = np.stack([codes & 15, codes >> 4], axis=-2).reshape(*codes.shape[:-2], -1, codes.shape[-1])
    *lead, k, n = codes.shape
    scale = np.repeat(np.asarray(arrays[SCALE], np.float64), fmt.group, axis=-2)
    w = codes.astype(np.float64) * scale
    if fmt.bits == 4:
        w += np.repeat(np.asarray(arrays[MIN], np.float64), fmt.group, axis=-2)
    return w


def bf16(a: np.ndarray) -> np.ndarray:
    """f64 values rounded to f32, then to bf16 (to nearest even), as f64."""
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def check(kind: str, m: int, k: int, panels: int, layer: int = 1, layers: int = 3, dtype=jnp.float32) -> None:
    panel = cpu_qmatmul.panel_width()
    n = panels * panel
    fmt = FORMATS[kind](k)
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x = rng.standard_normal((m, k), np.float32)
    arrays = quantize_kernel(jnp.asarray(rng.standard_normal((layers, k, n), np.float32)), fmt)
    stored = {name: to_panels(a, panel) for name, a in arrays.items()}
    got = np.asarray(jax.jit(cpu_qmatmul.layer_matmul, static_argnums=(2, 4))(x, stored, fmt, layer, dtype))
    w = reference_dequantize({name: np.asarray(a)[layer] for name, a in arrays.items()}, fmt)
    assert got.shape == (m, n) and got.dtype == np.float32
    tolerance = 4e-6 * np.abs(x.astype(np.float64) @ w).max() * np.sqrt(k)
    if dtype == jnp.bfloat16 and m >= cpu_qmatmul.panel_rows(fmt.bits):
        np.testing.assert_allclose(got, bf16(x) @ bf16(w), rtol=0, atol=tolerance)
        bound = (2**-8 + 2**-17 + k * 2**-23) * (np.abs(x) @ np.abs(w))  # bf16 rounding of x and w, f32 sums
        assert np.all(np.abs(got - x.astype(np.float64) @ w) <= bound)
    else:
        np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=0, atol=tolerance)


@pytest.mark.parametrize("kind", sorted(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 5, 33])
def test_every_tile_height(kind, m):
    check(kind, m, 96 if kind == "int8" else 128, 2)


@pytest.mark.parametrize("kind", sorted(FORMATS))
@pytest.mark.parametrize("m, panels", [(12, 2), (24, 1), (70, 3), (257, 2)])
def test_many_rows_dequantize_each_panel_once_and_give_the_same_products(kind, m, panels):
    """From 24 rows (4 bits: 12) a panel is dequantized into a buffer and f32 tiles run over it: row blocks
    split over the threads, tiles of every height left over."""
    check(kind, m, 96 if kind == "int8" else 128, panels)


BF16_CASES = [(1, 128, 3), (5, 128, 2), (12, 128, 2), (24, 96, 1), (70, 160, 3), (257, 64, 2)]


@pytest.mark.parametrize("kind", sorted(FORMATS))
@pytest.mark.parametrize("m, k, panels", BF16_CASES)
def test_a_bf16_model_multiplies_bf16_values_from_many_rows(kind, m, k, panels):
    """With bf16 weights the model's calls of many rows dequantize each panel into bf16 pairs and run
    the bf16 layer matmul's tiles on x rounded to bf16; fewer rows keep f32 products."""
    check(kind, m, k, panels, dtype=jnp.bfloat16)


def test_a_bf16_model_pairs_the_rows_of_an_odd_per_channel_group():
    """int8 per channel over an odd K: the last pair's second row is padding (zero weight, zero x)."""
    check("int8", 40, 97, 2, dtype=jnp.bfloat16)


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_one_row_over_an_odd_number_of_panels_and_each_layer(kind):
    for layer in range(3):
        check(kind, 1, 64, 3, layer=layer)


def test_the_quantizer_rounds_each_weight_to_its_groups_grid():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 64, 32), np.float32)
    for fmt in (QuantFormat(8, 64), QuantFormat(4, 32)):
        arrays = {name: np.asarray(a) for name, a in quantize_kernel(jnp.asarray(w), fmt).items()}
        assert {name: (a.shape, a.dtype) for name, a in arrays.items()} == fmt.arrays(w.shape)
        step = np.repeat(arrays[SCALE].astype(np.float64), fmt.group, axis=-2)
        error = np.abs(reference_dequantize(arrays, fmt) - w)
        assert np.all(error <= 0.5 * step * (1 + 1e-3) + 1e-6)  # f16 scales and mins round a little


def test_refuses_a_layer_out_of_range_and_codes_not_in_panels():
    fmt = QuantFormat(8, 64)
    arrays = quantize_kernel(jnp.ones((2, 64, cpu_qmatmul.panel_width())), fmt)
    stored = {name: to_panels(a, cpu_qmatmul.panel_width()) for name, a in arrays.items()}
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(jax.jit(cpu_qmatmul.layer_matmul, static_argnums=(2,))(jnp.ones((1, 64)), stored, fmt, 2))
    with pytest.raises(ValueError, match="in panels"):
        cpu_qmatmul.layer_matmul(jnp.ones((1, 64)), arrays, fmt, 0)


@pytest.mark.slow
def test_bf16_products_on_the_dot_product_tiles():
    """A bf16 model's many-row calls on the AVX512-BF16 dot-product tiles (bf16 pairs), which only AMD
    CPUs take by themselves (`dot_tiles_faster`; elsewhere the f32 tiles on values rounded to bf16,
    tested above): the bf16 tests again on kernels built to take them, in a subprocess."""
    if not cpu_matmul.bf16_dot():
        pytest.skip("no AVX512-BF16")
    env = {**os.environ, "JAXSERVE_CPU_KERNEL_FLAGS": "-DJAXSERVE_BF16_DOT_TILES=1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "bf16_model", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_paths_of_other_cpus():
    """The tests above on kernels built without AVX-512 (AVX2 vectors), in a subprocess (slow: a
    second build of the kernels; the same source's AVX-512 build is tested above in CI)."""
    env = {**os.environ, "JAXSERVE_CPU_KERNEL_FLAGS": "-mno-avx512f"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "not paths_of_other_cpus and (tile_height and (1- or 5-)) or odd_number or bf16_model",
            __file__,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    check = "from kernels_pallas import cpu_qmatmul; print(cpu_qmatmul.panel_width())"
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert done.stdout.split()[-1] == "32", done.stderr[-3000:]  # 8-float vectors
