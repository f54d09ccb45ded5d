"""Rotary position embeddings in the Hugging Face ("rotate half") convention.

The GGUF loader un-permutes Q/K weights into the Hugging Face layout, so one convention serves
every checkpoint format.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies [rotary_dim // 2] (rotary_dim = head_dim * partial_rotary_factor),
    with llama3 / linear scaling applied.

    `frequency_factors` is how GGUF files carry llama3 scaling: llama.cpp's converter stores
    each frequency's divisor (`rope_freqs`) instead of the parameters that produce it.
    """
    d = int(config.head_dim * config.partial_rotary_factor)  # the rotated features of each head
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq.astype(np.float32)
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if rope_type == "frequency_factors":
        return (inv_freq / np.asarray(scaling["factors"], np.float64)).astype(np.float32)
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, config.rope_theta, scaling).astype(np.float32)
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


def _yarn_inverse_frequencies(inv_freq: np.ndarray, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """YaRN (arXiv 2309.00071), with Hugging Face's parameters: frequencies that turn fewer than
    `beta_slow` times over the original context are interpolated (divided by `factor`), those
    that turn more than `beta_fast` times are kept, and a linear ramp blends the pairs between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    half = len(inv_freq)

    def pair_turning(rotations: float) -> float:  # the pair index that turns `rotations` times
        return half * math.log(original / (rotations * 2 * math.pi)) / math.log(theta)

    low, high = pair_turning(scaling.get("beta_fast") or 32), pair_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, 2 * half - 1)
    if low == high:
        high += 0.001
    keep = 1.0 - np.clip((np.arange(half) - low) / (high - low), 0.0, 1.0)  # 1: extrapolate (keep)
    return inv_freq / factor * (1.0 - keep) + inv_freq * keep


def attention_factor(config: ModelConfig) -> float:
    """YaRN's scale of cos and sin (so of the attention logits); 1 for every other RoPE."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, head_dim] for integer positions [T], both multiplied by `scale`."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, head_dim] rotated by position; computed in f32, returned in x's dtype. Tables
    narrower than the head (partial rotary) rotate its first features and pass the rest."""
    width = cos.shape[-1]
    xf = x[..., :width].astype(jnp.float32)
    half = width // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)
    return out if width == x.shape[-1] else jnp.concatenate([out, x[..., width:]], axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RopeTables:
    """cos and sin [T, head_dim] of a step's positions; with `local_cos` / `local_sin`, those of the
    sliding-window layers, whose RoPE has a base of its own (Gemma 3)."""

    cos: jax.Array
    sin: jax.Array
    local_cos: jax.Array | None = None
    local_sin: jax.Array | None = None

    def select(self, sliding: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(cos, sin) of a layer, sliding or not (a traced bool)."""
        if self.local_cos is None:
            return self.cos, self.sin
        return jnp.where(sliding, self.local_cos, self.cos), jnp.where(sliding, self.local_sin, self.sin)


def rope_tables(config: ModelConfig, positions: jax.Array) -> RopeTables:
    """The RoPE tables of `positions` [T] for every kind of layer of `config`."""
    cos, sin = rope_cos_sin(positions, inverse_frequencies(config), attention_factor(config))
    if config.rope_local_theta is None:
        return RopeTables(cos, sin)
    local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
    local_cos, local_sin = rope_cos_sin(positions, inverse_frequencies(local))
    return RopeTables(cos, sin, local_cos, local_sin)
