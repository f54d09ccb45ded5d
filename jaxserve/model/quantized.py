"""The matmuls on quantized kernels (`--quantization`; storage in `checkpoints.quant_format`): the
layers' projections and the output head. On CPU the C++ kernel (`kernels_pallas.cpu_qmatmul`, on
the arrays in panels: `panel_shape`), else a dequantize-then-dot in JAX, which XLA fuses into the
matmul on a GPU (the codes are read once, the dequantized kernel never written to memory).

An embedding table tied to the head is stored as the head's kernel [E, V] (`QuantizedEmbed`): the
logits are that kernel's matmul, and the lookup gathers the codes and scales of the tokens' columns
and dequantizes those alone (no f32 table is ever made)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from checkpoints.quant_format import CODES, MIN, SCALE, QuantFormat, format_of
from checkpoints.weights import LAYERS, Weight
from kernels_pallas import cpu_qmatmul
from kernels_pallas.cpu_matmul import CpuMatmul


def dequantize(arrays: dict[str, jax.Array], fmt: QuantFormat, dtype: Any) -> jax.Array:
    """The kernel [.., K, N] in `dtype` that quantized arrays [.., rows, N] store."""
    codes, scale = arrays[CODES], arrays[SCALE].astype(dtype)
    if fmt.bits == 4:
        codes = jnp.stack([codes & 15, codes >> 4], axis=-2).reshape(*codes.shape[:-2], -1, codes.shape[-1])
    *lead, k, n = codes.shape
    groups = codes.astype(dtype).reshape(*lead, k // fmt.group, fmt.group, n) * scale[..., None, :]
    if fmt.bits == 4:
        groups = groups + arrays[MIN].astype(dtype)[..., None, :]
    return groups.reshape(*lead, k, n)


def panel_shape(shape: tuple[int, ...], panel: int) -> tuple[int, ...]:
    """The shape `cpu_matmul.to_panels` gives an array [L, rows, N] of a stacked quantized kernel,
    or [rows, N] of a kernel of its own (a stack of one: [1, N / P, rows, P])."""
    *layers, rows, n = shape
    return (layers[0] if layers else 1), n // panel, rows, panel


def in_panels(arrays: dict[str, jax.Array]) -> bool:
    """Whether a quantized kernel's arrays are in the C++ kernel's panels [L, N / P, rows, P]."""
    return arrays[CODES].ndim == 4


def declare_arrays(module: nn.Module, codes: Weight, cpu_matmul: CpuMatmul | None) -> dict[str, jax.Array]:
    """The parameters of `module` storing the quantized kernel declared by `codes` (named as
    `QuantFormat.arrays` says): in panels where `cpu_matmul` is given and takes its output
    features, else as declared."""
    fmt = codes.quant
    shape = fmt.kernel_shape(codes.shape)
    native = cpu_matmul is not None and cpu_matmul.takes(shape[-1])
    arrays = {}
    for name, (array_shape, dtype) in fmt.arrays(shape).items():
        if native:
            array_shape = panel_shape(array_shape, cpu_matmul.panel)
        arrays[name] = module.param(name, nn.initializers.zeros, array_shape, dtype)
    return arrays


def stored_matmul(x: jax.Array, arrays: dict[str, jax.Array], layer: jax.Array | None, param_dtype: Any) -> jax.Array:
    """x [M, K] @ a quantized kernel (layer `layer` of a stacked one; None: a kernel of its own)
    -> f32 [M, N]: the C++ kernel on arrays in panels, else dequantize-then-dot in `param_dtype`."""
    fmt = format_of(arrays)
    if in_panels(arrays):
        return cpu_qmatmul.layer_matmul(x, arrays, fmt, 0 if layer is None else layer, param_dtype)
    if layer is not None:
        arrays = {name: a[layer] for name, a in arrays.items()}
    w = dequantize(arrays, fmt, param_dtype)
    return lax.dot_general(x.astype(param_dtype), w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def quantized_matmul(
    module: nn.Module,
    codes: Weight,
    x: jax.Array,
    layer: jax.Array | None,
    param_dtype: Any,
    cpu_matmul: CpuMatmul | None,
) -> jax.Array:
    """x @ the quantized kernel declared by `codes` (its arrays are `module`'s parameters:
    `declare_arrays`), for layer `layer` of a stacked kernel -> f32."""
    arrays = declare_arrays(module, codes, cpu_matmul)
    return stored_matmul(x, arrays, layer if codes.axes[0] == LAYERS else None, param_dtype)


def columns(arrays: dict[str, jax.Array], ids: jax.Array, dtype: Any) -> jax.Array:
    """Columns `ids` [T] of a quantized kernel of its own ([K, N], or in panels), dequantized to
    `dtype`, as rows [T, K]: a tied embedding table's rows. Only those columns' codes and scales
    are read."""
    fmt = format_of(arrays)
    if in_panels(arrays):
        panel = arrays[CODES].shape[-1]
        taken = {name: a[0, ids // panel, :, ids % panel].T for name, a in arrays.items()}  # [rows, T]
    else:
        taken = {name: jnp.take(a, ids, axis=-1) for name, a in arrays.items()}
    return dequantize(taken, fmt, dtype).T


class QuantizedEmbed(nn.Module):
    """An embedding table tied to the output head, stored quantized as the head's kernel [E, V]
    (`codes`: the declared codes, `embed/kernel`): `__call__` looks tokens up, `attend` is the head."""

    codes: Weight
    dtype: Any  # of the looked-up rows
    param_dtype: Any  # the dequantize-then-dot's
    cpu_matmul: CpuMatmul | None = None

    def setup(self) -> None:
        self.arrays = declare_arrays(self, self.codes, self.cpu_matmul)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return columns(self.arrays, tokens, jnp.float32).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits x [M, E] @ the head's kernel -> f32 [M, V]."""
        return stored_matmul(x, self.arrays, None, self.param_dtype)
