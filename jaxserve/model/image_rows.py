"""The rows of a prefill step that hold images' soft tokens (a vision-language model's)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ImageRows:
    """embeds [T, E] f32: the projector's output at each image row (zeros elsewhere);
    is_image [T] bool: the rows that take it instead of their token's embedding."""

    embeds: jax.Array
    is_image: jax.Array

    def merge(self, h: jax.Array) -> jax.Array:
        """Token embeddings h [T, E] with the image rows replaced (unscaled, as Gemma 3 does)."""
        return jnp.where(self.is_image[:, None], self.embeds.astype(h.dtype), h)
