"""Rotary position embeddings in the Hugging Face ("rotate half") convention.

The GGUF loader un-permutes Q/K weights into the Hugging Face layout, so one convention serves
every checkpoint format.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies [head_dim // 2], with llama3 / linear scaling applied.

    `frequency_factors` is how GGUF files carry llama3 scaling: llama.cpp's converter stores
    each frequency's divisor (`rope_freqs`) instead of the parameters that produce it.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq.astype(np.float32)
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if rope_type == "frequency_factors":
        return (inv_freq / np.asarray(scaling["factors"], np.float64)).astype(np.float32)
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return np.where(medium, blended, scaled).astype(np.float32)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}")


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, head_dim] for integer positions [T]."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, head_dim] rotated by position; computed in f32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    return out.astype(x.dtype)
