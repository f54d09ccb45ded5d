"""RMS norm over a declared scale, the one norm of every family served."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from checkpoints.weights import LAYERS, Weight


class RMSNorm(nn.Module):
    """RMS norm with the declared scale `weight`; a stacked scale [L, D] is indexed by `layer`."""

    weight: Weight
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        scale = self.param("scale", self.weight.flax_init(), self.weight.shape, jnp.float32)
        if self.weight.axes[0] == LAYERS:
            scale = scale[layer]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * scale).astype(self.dtype)
