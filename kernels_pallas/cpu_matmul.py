"""The model's matmuls for XLA:CPU as C++ kernels behind the XLA FFI (`cpu_matmul.cc`): a
layer's, on weights stored in panels, and the output head tied to the embedding.

Why: in the model's scanned layer loop, XLA:CPU copies each layer's slice of the stacked
weights before its dots (a second read and a write of all the weights every step), and its
dot of a few rows runs well below memory speed. The kernel reads layer `layer` of the stack in
place. The weights are laid out for it once, at load (`to_panels`): a stacked kernel [L, K, N]
becomes [L, N / P, K, P], P columns (`panel_width()`, four vector registers) contiguous over K,
so every register tile streams its weights in one run. On a 2-core AVX-512 machine, over a
30-layer stack of the default model's shapes, it is faster than XLA's dot of the [K, N] layout
at every row count (`python3 -m bench.matmul_cpu`), so it takes every call. The tied output
head, x [M, K] @ embedding [V, K].T, is a dot product per output: XLA:CPU's dot of one row reads
the embedding well below memory speed (from 8 rows it is as fast as the kernel, so it keeps them).
`cpu_build` compiles the source on first use.

bf16 weights: the same kernels on bf16 panels of pairs, [L, N / P, ceil(K / 2), P, 2] (rows 2i
and 2i + 1 of the weights side by side in each column), and a bf16 embedding; the activations
are rounded to bf16 in the kernel, the products summed in f32: x.astype(bf16) @ w in f32,
as XLA's bf16 dot with f32 accumulation computes it. Half the weight bytes a step streams, and
where the CPU has AVX512-BF16 (`bf16_dot()`) one instruction per two multiply-adds; elsewhere
the weights are widened to f32 in registers. Unlike XLA:CPU's bf16 dots, which widen the weights
in memory first (a bf16 engine on them was slower than f32), it is at least as fast as f32 at
every row count (`python3 -m bench.matmul_cpu --dtype bfloat16`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_build

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
LAYER, HEAD = "jaxserve_layer_matmul", "jaxserve_head_matmul"
LAYER_BF16, HEAD_BF16 = "jaxserve_layer_matmul_bf16", "jaxserve_head_matmul_bf16"
TARGETS = {
    LAYER: "JaxserveLayerMatmul",
    HEAD: "JaxserveHeadMatmul",
    LAYER_BF16: "JaxserveLayerMatmulBf16",
    HEAD_BF16: "JaxserveHeadMatmulBf16",
}
HEAD_K_MULTIPLE = 16  # the head kernel's K is a multiple of its vectors' width (8 or 16 floats)
HEAD_K_MULTIPLE_BF16 = 32  # bf16: of its vectors' width in pairs
HEAD_MAX_ROWS = 4  # the head kernel's calls: a single stream's decode (1.4x XLA's dot); ~1x at 8 rows
HEAD_MAX_ROWS_BF16 = 1 << 30  # bf16: every call (XLA's bf16 dot widens the embedding in memory first)
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@functools.cache
def panel_width() -> int:
    """Columns per panel of the built kernel (64 with AVX-512, 32 with AVX2)."""
    library = cpu_build.load(SOURCE)
    library.JaxserveMatmulPanel.restype = ctypes.c_int64
    return library.JaxserveMatmulPanel()


@functools.cache
def bf16_dot() -> bool:
    """Whether the built bf16 kernels multiply with AVX512-BF16's dot products (a CPU that has
    them, and a compiler that knows them); else they widen bf16 to f32 in registers."""
    library = cpu_build.load(SOURCE)
    library.JaxserveMatmulBf16Dot.restype = ctypes.c_int64
    return bool(library.JaxserveMatmulBf16Dot())


def to_panels(w: jax.Array, panel: int) -> jax.Array:
    """Stacked weights [L, K, N] as panels: f32 [L, N / panel, K, panel]; bf16 pairs [L, N /
    panel, ceil(K / 2), panel, 2] (an odd K padded with a zero row)."""
    layers, k, n = w.shape
    if w.dtype != jnp.bfloat16:
        return w.reshape(layers, k, n // panel, panel).transpose(0, 2, 1, 3)
    if k % 2:
        w = jnp.pad(w, ((0, 0), (0, 1), (0, 0)))
    return w.reshape(layers, (k + 1) // 2, 2, n // panel, panel).transpose(0, 3, 1, 4, 2)


@dataclasses.dataclass(frozen=True)
class CpuMatmul:
    """The model's matmuls on the C++ kernels (a Flax module attribute): the scanned layers', on
    stacked f32 or bf16 kernels stored as panels of `panel` columns (those whose output features
    are a multiple of it: `takes`, `stored_shape`, `to_panels`), and the output head tied to the
    embedding (`head`)."""

    panel: int

    def takes(self, features: int) -> bool:
        """Whether a kernel of `features` output features is stored in panels for this matmul."""
        return features % self.panel == 0

    def stored_shape(self, layers: int, fan_in: int, features: int, dtype=jnp.float32) -> tuple[int, ...]:
        """The shape `to_panels` gives stacked weights [layers, fan_in, features] of `dtype`."""
        if jnp.dtype(dtype) == jnp.bfloat16:
            return layers, features // self.panel, (fan_in + 1) // 2, self.panel, 2
        return layers, features // self.panel, fan_in, self.panel

    def __call__(self, x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
        """x [M, K] @ layer `layer` of panels w (`to_panels`: f32 or bf16) -> f32 [M, N]."""
        if w.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"the cpu layer matmul takes f32 or bf16 weights, not {w.dtype}")
        want = self.stored_shape(w.shape[0], x.shape[1], w.shape[1] * self.panel, w.dtype)
        if x.ndim != 2 or w.shape != want:
            raise ValueError(
                f"the cpu layer matmul takes x [M, K] and its panels of {w.dtype} {want}, not {x.shape} and {w.shape}"
            )
        cpu_build.register(SOURCE, TARGETS)
        target = LAYER_BF16 if w.dtype == jnp.bfloat16 else LAYER
        if w.dtype == jnp.float32 or x.dtype != jnp.bfloat16:
            x = x.astype(jnp.float32)  # the bf16 kernel rounds f32 rows itself, once per call
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1] * self.panel), jnp.float32))
        return call(x, w, jnp.asarray(layer, jnp.int32).reshape(()))

    @staticmethod
    def takes_head(x: jax.Array, embedding: jax.Array) -> bool:
        """Whether `head` takes these: an f32 embedding with at most HEAD_MAX_ROWS rows of x (from
        8 rows XLA's dot is as fast or faster) and K a multiple of HEAD_K_MULTIPLE, or a bf16 one
        with at most HEAD_MAX_ROWS_BF16 rows and K a multiple of HEAD_K_MULTIPLE_BF16."""
        if embedding.dtype == jnp.float32:
            return x.shape[0] <= HEAD_MAX_ROWS and x.shape[1] % HEAD_K_MULTIPLE == 0
        return (
            embedding.dtype == jnp.bfloat16
            and x.shape[0] <= HEAD_MAX_ROWS_BF16
            and x.shape[1] % HEAD_K_MULTIPLE_BF16 == 0
        )

    def head(self, x: jax.Array, embedding: jax.Array, live: jax.Array | None = None) -> jax.Array:
        """Logits of the output head tied to an f32 or bf16 `embedding` [V, K]: x [M, K] @
        embedding.T -> f32 [M, V] (with a bf16 one, x rounded to bf16), for what `takes_head`.
        `live` (an int32 scalar, default M): only the first `live` rows are computed, the others
        are zeros (a step's padding rows)."""
        if not self.takes_head(x, embedding):
            raise ValueError(
                f"the cpu head matmul does not take x {x.shape} and an embedding {embedding.shape} of {embedding.dtype}"
            )
        cpu_build.register(SOURCE, TARGETS)
        bf16 = embedding.dtype == jnp.bfloat16
        if not (bf16 and x.dtype == jnp.bfloat16):
            x = x.astype(jnp.float32)
        call = jax.ffi.ffi_call(
            HEAD_BF16 if bf16 else HEAD, jax.ShapeDtypeStruct((x.shape[0], embedding.shape[0]), jnp.float32)
        )
        live = x.shape[0] if live is None else live
        return call(x, embedding, jnp.asarray(live, jnp.int32).reshape(()))


def kernels() -> CpuMatmul:
    """The matmuls of this machine's built kernels."""
    return CpuMatmul(panel_width())
