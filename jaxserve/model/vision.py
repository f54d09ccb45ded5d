"""Vision towers (`checkpoints.architectures.gemma3_vision`, `idefics3_vision`): pixels -> soft-token embeddings.

A pure function of the declared parameters and a batch of preprocessed images, jit-compiled by
the runner per image-count bucket (its `vision` program). Every patch attends to every patch of
its image (no mask: the images are all the same size); layers are scanned over their stacked
weights. Computed in f32; the result is cast to the language model's activations by the caller.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.architectures import gemma3_vision, idefics3_vision
from checkpoints.architectures.gemma3_vision import VisionConfig

Tower = gemma3_vision.VisionConfig | idefics3_vision.VisionConfig  # the encoder of either family

_HIGHEST = jax.lax.Precision.HIGHEST


def _layer_norm(x: jax.Array, norm: dict[str, jax.Array], eps: float) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * norm["scale"] + norm["bias"]


def _linear(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return jnp.matmul(x, p["kernel"].astype(jnp.float32), precision=_HIGHEST) + p["bias"]


def _patches(v: Tower, pixels: jax.Array) -> jax.Array:
    """[B, 3, H, W] -> [B, N, 3 * P * P]: each patch's pixels in (channel, row, column) order,
    the patches row by row (the order of a strided convolution's outputs, flattened)."""
    b, s, p = pixels.shape[0], v.patches_per_side, v.patch_size
    x = pixels.reshape(b, 3, s, p, s, p).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, s * s, 3 * p * p)


def _attention(v: Tower, p: dict[str, Any], h: jax.Array) -> jax.Array:
    b, n, c = h.shape
    q, k, val = (_linear(h, p[name]).reshape(b, n, v.num_heads, v.head_dim) for name in ("q_proj", "k_proj", "v_proj"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_HIGHEST) * v.head_dim**-0.5
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, val, precision=_HIGHEST).reshape(b, n, c)
    return _linear(out, p["o_proj"])


def encode_patches(v: Tower, params: dict[str, Any], pixels: jax.Array) -> jax.Array:
    """The SigLIP encoder's last hidden states [B, N, C] (f32) of images `pixels` [B, 3, H, W]."""
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    h = _linear(_patches(v, pixels.astype(jnp.float32)), f32["patch_embed"]) + f32["position_embed"]["embedding"]
    eps = v.layer_norm_eps

    def layer(h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        h = h + _attention(v, p, _layer_norm(h, p["attn_norm"], eps))
        mlp = _linear(jax.nn.gelu(_linear(_layer_norm(h, p["mlp_norm"], eps), p["fc1"]), approximate=True), p["fc2"])
        return h + mlp, None

    h, _ = jax.lax.scan(layer, h, f32["layers"])
    return _layer_norm(h, f32["post_norm"], eps)


def project(v: VisionConfig, params: dict[str, Any], hidden: jax.Array) -> jax.Array:
    """The projector: patch states [B, N, C] -> soft tokens [B, mm_tokens_per_image, E] (f32):
    average pools of `pool_kernel` x `pool_kernel` patches (row by row), RMS norm, projection."""
    b, _, c = hidden.shape
    s, k = v.patches_per_side, v.pool_kernel
    grid = hidden.reshape(b, s // k, k, s // k, k, c).mean(axis=(2, 4)).reshape(b, -1, c)
    norm = params["projector"]["norm"]["scale"].astype(jnp.float32)
    normed = grid * jax.lax.rsqrt(jnp.square(grid).mean(-1, keepdims=True) + v.layer_norm_eps) * norm
    return jnp.matmul(normed, params["projector"]["kernel"].astype(jnp.float32), precision=_HIGHEST)


def connect(v: idefics3_vision.VisionConfig, params: dict[str, Any], hidden: jax.Array) -> jax.Array:
    """Idefics3's connector: patch states [B, N, C] -> tokens [B, N / r**2, E] (f32), r = scale_factor.
    The pixel shuffle makes each r x r block of patches (blocks row by row) one token whose features
    are the block's patches' in row-major order; a linear layer projects them."""
    b, _, c = hidden.shape
    s, r = v.patches_per_side, v.scale_factor
    blocks = hidden.reshape(b, s // r, r, s // r, r, c).transpose(0, 1, 3, 2, 4, 5)
    shuffled = blocks.reshape(b, (s // r) ** 2, r * r * c)
    return jnp.matmul(shuffled, params["projector"]["kernel"].astype(jnp.float32), precision=_HIGHEST)


def image_embeddings(v: Tower, params: dict[str, Any], pixels: jax.Array) -> jax.Array:
    """Soft-token embeddings [B, mm_tokens_per_image, E] (f32) of preprocessed images [B, 3, H, W]."""
    hidden = encode_patches(v, params, pixels)
    if v.family == idefics3_vision.FAMILY:
        return connect(v, params, hidden)
    return project(v, params, hidden)
