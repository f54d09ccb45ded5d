"""The model's layer matmuls on weight-only quantized kernels for XLA:CPU: C++ kernels behind the
XLA FFI (`cpu_qmatmul.cc`), on int8 codes with f32 scales or 4-bit codes with f16 scales and mins
(`checkpoints.quant_format`), stored in the panels of the f32 layer matmul (`cpu_matmul.to_panels`
of each array: [L, N / P, rows, P]) so that a tile streams its codes in one run.

Why a kernel: XLA:CPU converts int8 or bf16 weights of a dot in memory before multiplying (a
matrix-vector product on them is ~15x slower than on f32), so a dequantize-then-dot in JAX
streams more bytes than the f32 weights, not fewer. The kernel dequantizes in registers: a step
reads 1 byte (int8) or half a byte (4 bits) a weight, and sums the products in f32. At many rows
it dequantizes each panel once into a buffer and runs the layer matmul's register tiles on it
(`cpu_panel_tiles.h`): in a bf16 model on bf16 pairs, the bf16 matmul's products at its speed.
`cpu_build` compiles the source on first use.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.quant_format import CODES, MIN, SCALE, QuantFormat
from kernels_pallas import cpu_build

SOURCE = Path(__file__).with_name("cpu_qmatmul.cc")
INT8, INT4 = "jaxserve_int8_matmul", "jaxserve_int4_matmul"
TARGETS = {INT8: "JaxserveInt8Matmul", INT4: "JaxserveInt4Matmul"}


@functools.cache
def panel_width() -> int:
    """Columns per panel of the built kernel (the f32 layer matmul's: 64 with AVX-512, 32 with AVX2)."""
    library = cpu_build.load(SOURCE)
    library.JaxserveQMatmulPanel.restype = ctypes.c_int64
    return library.JaxserveQMatmulPanel()


@functools.cache
def panel_rows(bits: int) -> int:
    """The fewest rows from which a call on `bits`-bit codes dequantizes each panel once (and in a
    bf16 model multiplies bf16 values: `layer_matmul`)."""
    library = cpu_build.load(SOURCE)
    library.JaxserveQMatmulPanelRows.restype = ctypes.c_int64
    library.JaxserveQMatmulPanelRows.argtypes = [ctypes.c_int64]
    return library.JaxserveQMatmulPanelRows(bits)


def layer_matmul(
    x: jax.Array, arrays: dict[str, jax.Array], fmt: QuantFormat, layer: jax.Array, dtype: Any = jnp.float32
) -> jax.Array:
    """x [M, K] @ layer `layer` of a quantized kernel whose arrays (`QuantFormat.arrays`: codes,
    scales, and mins for 4 bits) are each in panels [L, N / P, rows, P] -> f32 [M, N]. `dtype`: the
    model's weights' (what the kernel dequantizes to off the CPU kernel): with bf16, a call of many
    rows multiplies bf16 values (the dequantized weights and x rounded to bf16, as the bf16 layer
    matmul and XLA's bf16 dot do) at the bf16 matmul's speed; calls of fewer rows (`panel_rows`), and
    f32, multiply in f32."""
    codes = arrays[CODES]
    if codes.ndim != 4 or codes.shape[-1] != panel_width():
        raise ValueError(f"the quantized cpu matmul takes codes in panels of {panel_width()}, not {codes.shape}")
    cpu_build.register(SOURCE, TARGETS)
    out = jax.ShapeDtypeStruct((x.shape[0], codes.shape[1] * codes.shape[3]), jnp.float32)
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    x = x.astype(jnp.float32)
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    if fmt.bits == 8:
        return jax.ffi.ffi_call(INT8, out)(x, codes, arrays[SCALE], layer, bf16=bf16)
    return jax.ffi.ffi_call(INT4, out)(x, codes, arrays[SCALE], arrays[MIN], layer, bf16=bf16)
