"""The model's matmuls: `matmul` (in the weights' dtype, f32 accumulation), `Linear` on a declared
kernel however it is stored (plain, packed pairs, the cpu matmul's panels, quantized), and
`DeclaredParams` for declared stacks read whole."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from checkpoints.weights import LAYERS, Weight
from jaxserve.model.quantized import quantized_matmul
from kernels_pallas.cpu_matmul import CpuMatmul, to_panels


def matmul(x: jax.Array, w: jax.Array, contract_w: int = 0) -> jax.Array:
    """x [N, K] times w (K on axis `contract_w` of a 2-D w), multiplied in w's dtype and
    accumulated in f32. A single row of 2-byte weights is padded to two: XLA:CPU rewrites a
    one-row product into a multiply-reduce that converts the weights element by element
    (a batch-1 bf16 decode step ~2.5x an f32 one); the spare row costs nothing elsewhere."""
    dims = (((1,), (contract_w,)), ((), ()))
    if x.shape[0] == 1 and w.dtype.itemsize == 2:
        return lax.dot_general(
            jnp.pad(x, ((0, 1), (0, 0))).astype(w.dtype), w, dims, preferred_element_type=jnp.float32
        )[:1]
    return lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=jnp.float32)


class Linear(nn.Module):
    """x @ kernel (+ bias), in the weights' dtype with f32 accumulation, returned in `dtype`.
    Parameter names are nn.Dense's; shapes come from the declared `kernel` and `bias`. `packed`:
    the kernel is stored as `pack_kernels` makes it. A stacked kernel [L, in, out] (and bias) is
    indexed by `layer`, with `cpu_matmul(x, kernel, layer)` on a kernel stored in its panels where
    one is given that takes these features (`panel_kernels`). A quantized kernel (the declared
    codes' `quant`) is read by `quantized_matmul`."""

    kernel: Weight
    bias: Weight | None
    dtype: Any  # of the output
    param_dtype: Any
    packed: bool = False
    cpu_matmul: CpuMatmul | None = None

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        stacked = self.kernel.axes[0] == LAYERS
        take = (lambda p: p[layer]) if stacked else (lambda p: p)  # noqa: E731
        shape = self.kernel.shape
        fan_in, features = shape[-2:]
        if self.kernel.quant is not None:
            y = quantized_matmul(self, self.kernel, x, layer, self.param_dtype, self.cpu_matmul)
        elif stacked and self.cpu_matmul is not None and self.cpu_matmul.takes(features):
            lm, init = self.cpu_matmul, self.kernel.flax_init()
            panels = lambda key, _, dtype: to_panels(init(key, shape, dtype), lm.panel)  # noqa: E731
            y = lm(x, self.param("kernel", panels, lm.stored_shape(*shape, self.param_dtype), self.param_dtype), layer)
        elif self.packed:
            words = self.param("kernel", nn.initializers.zeros, (*shape[:-1], features // 2), jnp.uint32)
            y = matmul(x, lax.bitcast_convert_type(take(words), self.param_dtype).reshape(fan_in, features))
        else:
            kernel = self.param("kernel", self.kernel.flax_init(), shape, self.param_dtype)
            y = matmul(x, take(kernel))
        if self.bias is not None:
            y = y + take(self.param("bias", self.bias.flax_init(), self.bias.shape, self.param_dtype))
        return y.astype(self.dtype)


class DeclaredParams(nn.Module):
    """Declared parameters read whole (the stacked expert weights, which the experts' grouped
    matmuls index by layer and expert themselves): `<name>/<leaf>` for each (leaf, weight), in
    the weights' dtype (f32 where declared so); returned by leaf."""

    leaves: tuple[tuple[str, Weight], ...]
    param_dtype: Any
    leaf: str = "kernel"

    @nn.compact
    def __call__(self) -> dict[str, jax.Array]:
        return {leaf: self.param(leaf, w.flax_init(), w.shape, w.dtype(self.param_dtype)) for leaf, w in self.leaves}
