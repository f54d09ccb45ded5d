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
the embedding well below memory speed (from 8 rows it is as fast as the kernel, so it keeps them). `cpu_build` compiles the source on
first use.
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
TARGETS = {LAYER: "JaxserveLayerMatmul", HEAD: "JaxserveHeadMatmul"}
HEAD_K_MULTIPLE = 16  # the head kernel's K is a multiple of its vectors' width (8 or 16 floats)
HEAD_MAX_ROWS = 4  # the head kernel's calls: a single stream's decode (1.4x XLA's dot); ~1x at 8 rows


@functools.cache
def panel_width() -> int:
    """Columns per panel of the built kernel (64 with AVX-512, 32 with AVX2)."""
    library = cpu_build.load(SOURCE)
    library.JaxserveMatmulPanel.restype = ctypes.c_int64
    return library.JaxserveMatmulPanel()


def to_panels(w: jax.Array, panel: int) -> jax.Array:
    """Stacked weights [L, K, N] as panels [L, N / panel, K, panel]."""
    layers, k, n = w.shape
    return w.reshape(layers, k, n // panel, panel).transpose(0, 2, 1, 3)


@dataclasses.dataclass(frozen=True)
class CpuMatmul:
    """The model's matmuls on the C++ kernels (a Flax module attribute): the scanned layers', on
    stacked f32 kernels stored as panels of `panel` columns (those whose output features are a
    multiple of it: `takes`, `stored_shape`, `to_panels`), and the output head tied to the
    embedding (`head`)."""

    panel: int

    def takes(self, features: int) -> bool:
        """Whether a kernel of `features` output features is stored in panels for this matmul."""
        return features % self.panel == 0

    def stored_shape(self, layers: int, fan_in: int, features: int) -> tuple[int, int, int, int]:
        return layers, features // self.panel, fan_in, self.panel

    def __call__(self, x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
        """x [M, K] @ layer `layer` of panels w [L, N / P, K, P] -> f32 [M, N]."""
        if w.dtype != jnp.float32:
            raise ValueError(f"the cpu layer matmul takes f32 weights, not {w.dtype}")
        if w.ndim != 4 or w.shape[3] != self.panel or w.shape[2] != x.shape[1]:
            raise ValueError(f"the cpu layer matmul takes x [M, K] and panels [L, N / {self.panel}, K, "
                             f"{self.panel}], not {x.shape} and {w.shape}")
        cpu_build.register(SOURCE, TARGETS)
        call = jax.ffi.ffi_call(LAYER, jax.ShapeDtypeStruct((x.shape[0], w.shape[1] * self.panel), jnp.float32))
        return call(x.astype(jnp.float32), w, jnp.asarray(layer, jnp.int32).reshape(()))

    @staticmethod
    def takes_head(x: jax.Array, embedding: jax.Array) -> bool:
        """Whether `head` takes these: f32, at most HEAD_MAX_ROWS rows (from 8 rows XLA's dot is
        as fast or faster), K a multiple of HEAD_K_MULTIPLE."""
        return (embedding.dtype == jnp.float32 and x.shape[0] <= HEAD_MAX_ROWS
                and x.shape[1] % HEAD_K_MULTIPLE == 0)

    def head(self, x: jax.Array, embedding: jax.Array) -> jax.Array:
        """Logits of the output head tied to an f32 `embedding` [V, K]: x [M, K] @ embedding.T ->
        f32 [M, V], for what `takes_head`."""
        if not self.takes_head(x, embedding):
            raise ValueError(f"the cpu head matmul does not take x {x.shape} and an embedding "
                             f"{embedding.shape} of {embedding.dtype}")
        cpu_build.register(SOURCE, TARGETS)
        call = jax.ffi.ffi_call(HEAD, jax.ShapeDtypeStruct((x.shape[0], embedding.shape[0]), jnp.float32))
        return call(x.astype(jnp.float32), embedding)


def kernels() -> CpuMatmul:
    """The matmuls of this machine's built kernels."""
    return CpuMatmul(panel_width())
