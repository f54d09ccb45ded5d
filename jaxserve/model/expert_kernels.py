"""The experts' kernels as the grouped matmuls read them (`jaxserve.model.experts`).

A stack of expert kernels is an array [L, X, K, N] (in, out), or gpt-oss's MXFP4 storage as the
checkpoint holds it (`checkpoints.mxfp4`): {"blocks": uint8 [L, X, N, K / 32, 16], "scales":
uint8 [L, X, N, K / 32]}. An MXFP4 kernel is dequantized where it is used, one expert's (the CPU
loop's tile) or one layer's (`ragged_dot`) at a time: the stored codes are what stays in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from checkpoints import mxfp4

ExpertStack = jax.Array | dict[str, jax.Array]


def num_experts(w: ExpertStack) -> int:
    """X, the experts of the stack."""
    return jax.tree.leaves(w)[0].shape[1]


def out_features(w: ExpertStack) -> int:
    """N, the outputs of each kernel."""
    return w[mxfp4.SCALES].shape[2] if isinstance(w, dict) else w.shape[-1]


def dequantize_mxfp4(blocks: jax.Array, scales: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
    """MXFP4 blocks [.., N, G, 16] and scales [.., N, G] -> the kernel [.., G * 32, N] in `dtype`
    (exact: e2m1 values times a power of two)."""
    lut = jnp.asarray(mxfp4.E2M1, jnp.float32)
    codes = jnp.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], mxfp4.BLOCK)
    values = jnp.ldexp(lut[codes], scales.astype(jnp.int32)[..., None] - mxfp4.SCALE_BIAS)
    return jnp.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2).astype(dtype)


def expert_kernel(w: ExpertStack, layer: jax.Array, expert: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
    """Expert `expert`'s kernel [K, N] of layer `layer`: read in place from an array (its own
    dtype), or dequantized to `dtype` from MXFP4."""
    if not isinstance(w, dict):
        return jnp.asarray(w)[layer, expert]
    return dequantize_mxfp4(w[mxfp4.BLOCKS][layer, expert], w[mxfp4.SCALES][layer, expert], dtype)


def layer_kernels(w: ExpertStack, layer: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
    """Every expert's kernel [X, K, N] of layer `layer` (MXFP4 dequantized to `dtype`)."""
    if not isinstance(w, dict):
        return w[layer]
    return dequantize_mxfp4(w[mxfp4.BLOCKS][layer], w[mxfp4.SCALES][layer], dtype)
