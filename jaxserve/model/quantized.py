"""The layers' matmuls on quantized kernels (`--quantization`; storage in
`checkpoints.quant_format`): the C++ kernel on CPU (`kernels_pallas.cpu_qmatmul`, on the arrays
in panels: `panel_arrays`), else a dequantize-then-dot in JAX, which XLA fuses into the matmul
on a GPU (the codes are read once, the dequantized kernel never written to memory)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from checkpoints.quant_format import CODES, MIN, SCALE, QuantFormat
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
    """The shape `cpu_matmul.to_panels` gives a stacked array [L, rows, N] of a quantized kernel."""
    layers, rows, n = shape
    return layers, n // panel, rows, panel


def quantized_matmul(module: nn.Module, codes: Weight, x: jax.Array, layer: jax.Array | None, param_dtype: Any,
                     cpu_matmul: CpuMatmul | None) -> jax.Array:
    """x @ the quantized kernel declared by `codes` (its arrays are `module`'s parameters, named
    as `QuantFormat.arrays` says), for layer `layer` of a stacked kernel -> f32. On the C++ kernel
    where `cpu_matmul` is given and takes its output features (the arrays then in panels)."""
    fmt = codes.quant
    shape = fmt.kernel_shape(codes.shape)
    stacked = codes.axes[0] == LAYERS
    native = stacked and cpu_matmul is not None and cpu_matmul.takes(shape[-1])
    arrays = {}
    for name, (array_shape, dtype) in fmt.arrays(shape).items():
        if native:
            array_shape = panel_shape(array_shape, cpu_matmul.panel)
        arrays[name] = module.param(name, nn.initializers.zeros, array_shape, dtype)
    if native:
        return cpu_qmatmul.layer_matmul(x, arrays, fmt, layer)
    if stacked:
        arrays = {name: a[layer] for name, a in arrays.items()}
    w = dequantize(arrays, fmt, param_dtype)
    return lax.dot_general(x.astype(param_dtype), w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
