"""The forward pass of a BERT-family encoder (`checkpoints.encoders`): a pure function of the
declared parameters and a padded batch, jit-compiled per shape bucket by `jaxserve.encoder`.

Rows are sequences padded on the right to the bucket's token count; every token attends to every
real token of its row (bidirectional: no causal mask, and no KV cache outlives the call). Blocks
are post-LayerNorm: `h = LN(h + attn(h))`, `h = LN(h + mlp(h))`. BERT adds absolute position
embeddings and uses a GELU (erf) MLP with biases; nomic-bert rotates q and k (NeoX halves), fuses
q/k/v and uses SwiGLU, without biases. Layers are scanned over their stacked weights, so compile
time does not grow with depth.

A cross-encoder (`EncoderConfig.is_cross_encoder`) reads a pair of texts as one row: the tokens after
the first [SEP] are segment 1 (their token-type embedding), and its pooled CLS row goes through BERT's
pooler (dense + tanh) and classifier to one logit (`pooled_outputs`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.encoders.config import EncoderConfig

_MASKED = -1e30


def _layer_norm(x: jax.Array, norm: dict[str, jax.Array], eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * norm["scale"] + norm["bias"]


def _linear(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    y = x @ p["kernel"].astype(x.dtype)
    return y + p["bias"] if "bias" in p else y


def _rotate(x: jax.Array, theta: float) -> jax.Array:
    """Rotary positions on [B, T, H, D], NeoX style (the two halves of each head rotate together)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # [T, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _attention(config: EncoderConfig, p: dict[str, Any], h: jax.Array, key_mask: jax.Array) -> jax.Array:
    b, t, e = h.shape
    if config.rotary:
        q, k, v = jnp.split(_linear(h, p["qkv"]), 3, axis=-1)
    else:
        q, k, v = _linear(h, p["q"]), _linear(h, p["k"]), _linear(h, p["v"])
    q, k, v = (x.reshape(b, t, config.num_heads, config.head_dim) for x in (q, k, v))
    if config.rotary:
        q, k = _rotate(q, config.rope_theta), _rotate(k, config.rope_theta)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(config.head_dim))
    scores = jnp.where(key_mask[:, None, None, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    return _linear(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, e), p["attn_out"])


def _mlp(config: EncoderConfig, p: dict[str, Any], h: jax.Array) -> jax.Array:
    if config.architecture == "nomic_bert":
        hidden = _linear(h, p["up"]) * jax.nn.silu(_linear(h, p["gate"]))
    else:
        hidden = jax.nn.gelu(_linear(h, p["up"]), approximate=False)
    return _linear(hidden, p["down"])


def token_types(config: EncoderConfig, token_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids: 0 everywhere for an embedding model; for a cross-encoder, 1 after the
    row's first [SEP] (BERT's pair template `[CLS] a [SEP] b [SEP]`)."""
    if not config.is_cross_encoder:
        return jnp.zeros_like(token_ids)
    seps = jnp.cumsum(token_ids == config.sep_token_id, axis=1)
    return jnp.minimum(seps - (token_ids == config.sep_token_id), 1).astype(jnp.int32)


def encode(config: EncoderConfig, params: dict[str, Any], token_ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """Final hidden states [B, T, E] (f32) of rows `token_ids` [B, T] whose first `lengths` [B]
    tokens are real (the rest is padding, which nothing attends to)."""
    t = token_ids.shape[1]
    embed = params["embed"]
    h = embed["tokens"][token_ids].astype(jnp.float32) + embed["token_types"][token_types(config, token_ids)]
    if not config.rotary:
        h = h + embed["positions"][:t]
    h = _layer_norm(h, embed["norm"], config.layer_norm_eps)
    key_mask = jnp.arange(t)[None, :] < lengths[:, None]

    def layer(h: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        h = _layer_norm(h + _attention(config, p, h, key_mask), p["attn_norm"], config.layer_norm_eps)
        return _layer_norm(h + _mlp(config, p, h), p["mlp_norm"], config.layer_norm_eps), None

    h, _ = jax.lax.scan(layer, h, params["layers"])
    return h


def pooled_sums(
    config: EncoderConfig, params: dict[str, Any], token_ids: jax.Array, lengths: jax.Array, weights: jax.Array
) -> jax.Array:
    """Per row, the sum of its final hidden states weighted by `weights` [B, T] (1 on the rows
    its `jaxserve.pooling.Pooler` takes, else 0): [B, E] f32."""
    return jnp.einsum("bt,bte->be", weights, encode(config, params, token_ids, lengths))


def pooled_outputs(
    config: EncoderConfig, params: dict[str, Any], token_ids: jax.Array, lengths: jax.Array, weights: jax.Array
) -> jax.Array:
    """What each row serves: its pooled sums [B, E] (an embedding model), or a cross-encoder's logit
    [B, 1] of its CLS row (`weights` one-hot on row 0, so the sum is that row)."""
    pooled = pooled_sums(config, params, token_ids, lengths, weights)
    if not config.is_cross_encoder:
        return pooled
    hidden = jnp.tanh(_linear(pooled, params["pooler"]))
    return _linear(hidden, params["classifier"])
