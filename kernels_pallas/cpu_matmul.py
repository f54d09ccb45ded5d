"""A layer's matmul for XLA:CPU as a C++ kernel behind the XLA FFI (`cpu_matmul.cc`).

Why: in the model's scanned layer loop, XLA:CPU copies each layer's slice of the stacked
weights before its dots (a second read and a write of all the weights every step), and its
dot of a few rows runs well below memory speed. `layer_matmul(x, w, layer)` reads layer
`layer` of the stacked weights in place, in register tiles (wider the fewer the rows) that
walk 64 weight rows a pass, on XLA's intra-op threads. Measured on a 2-core AVX2 machine over
a 30-layer stack of the default model's shapes, XLA's time over the kernel's: 1.8x at 1 row,
1.9x at 4 and 8, 1.35x at 32, 1.0x at 64 (0.8x at 512 before passes), so calls of more than
`MAX_ROWS` rows take XLA's dot.
`cpu_build` compiles the source on first use.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build

TARGET = "jaxserve_layer_matmul"
SOURCE = Path(__file__).with_name("cpu_matmul.cc")
MAX_ROWS = 32


@functools.cache
def lanes() -> int:
    """Floats per vector of the built kernel: the output features must be a multiple of it."""
    library = cpu_build.load(SOURCE)
    library.JaxserveMatmulLanes.restype = ctypes.c_int64
    return library.JaxserveMatmulLanes()


def layer_matmul(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
    """x [M, K] @ w[layer] for stacked f32 weights w [L, K, N] -> f32 [M, N]: the kernel for at
    most `MAX_ROWS` rows and N a multiple of `lanes()`, else XLA's dot of the layer's slice."""
    if w.dtype != jnp.float32:
        raise ValueError(f"the cpu layer matmul takes f32 weights, not {w.dtype}")
    m, n = x.shape[0], w.shape[2]
    if m > MAX_ROWS or n % lanes():
        return jnp.dot(x.astype(jnp.float32), w[layer], preferred_element_type=jnp.float32)
    cpu_build.register(SOURCE, {TARGET: "JaxserveLayerMatmul"})
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.float32), w, jnp.asarray(layer, jnp.int32).reshape(()))
