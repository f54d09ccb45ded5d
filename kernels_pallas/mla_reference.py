"""Pure-JAX paged multi-head latent attention (MLA) in its absorbed form: the oracle of the MLA
kernels, and the MLA backend where no kernel is chosen.

The cache holds one latent row per token, [c_kv | k_pe] (`kv_lora_rank` + `qk_rope_head_dim`
values), as one head split in two halves (`split_latent`): the K cache holds the first half of
c_kv and of k_pe, the V cache the second halves, each `[num_layers, 1, num_blocks, block_size,
W / 2]` (`jaxserve.model.kv_cache.cache_heads`). Splitting each part keeps every piece a kernel
loads a power of two wide where the ranks are (DeepSeek-V3: 256 + 32 per half).
Absorbed attention is multi-query attention over those rows: each head's query is [q_nope
absorbed into the latent space | q_pe rotated] (W values), its key the whole row and its value
the row's first `latent_dim` values (c_kv). The output is in latent space, [.., H, latent_dim].

The signatures are those of `reference.decode_attention` / `reference.prefill_attention` with
`latent_dim` added, and the same conventions (lengths count the new tokens, whose latents are in
the cache already; padding rows come back as zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import kv_quant
from kernels_pallas.reference import _HIGHEST, _MASKED, token_layout


def split_latent(latent: jax.Array, latent_dim: int) -> tuple[jax.Array, jax.Array]:
    """Latent rows [..., W] ([c_kv | k_pe], c_kv `latent_dim` wide) -> their K and V halves."""
    c, pe = latent[..., :latent_dim], latent[..., latent_dim:]
    hc, hp = latent_dim // 2, pe.shape[-1] // 2
    return jnp.concatenate([c[..., :hc], pe[..., :hp]], -1), jnp.concatenate([c[..., hc:], pe[..., hp:]], -1)


def join_latent(k: jax.Array, v: jax.Array, latent_dim: int) -> jax.Array:
    """The inverse of `split_latent`: K and V halves [..., W / 2] -> latent rows [..., W]."""
    hc = latent_dim // 2
    return jnp.concatenate([k[..., :hc], v[..., :hc], k[..., hc:], v[..., hc:]], -1)


def _latent_pages(
    k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, block_tables: jax.Array, latent_dim: int
) -> jax.Array:
    """The sequences' latent rows in order: [S, W * BS, W] (halves joined, their values as
    `kv_quant.dequantize` gives them) in f32."""
    k = kv_quant.dequantize(k_cache[layer, 0][block_tables])  # [S, W, BS, half]
    v = kv_quant.dequantize(v_cache[layer, 0][block_tables])
    rows = join_latent(k, v, latent_dim).astype(jnp.float32)
    s, w, bs, d = rows.shape
    return rows.reshape(s, w * bs, d)


def mla_decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    latent_dim: int,
) -> jax.Array:
    """q [B, H, W] -> [B, H, latent_dim]; sequence b attends to its first `lengths[b]` latents."""
    rows = _latent_pages(k_cache, v_cache, layer, block_tables, latent_dim)  # [B, C, W]
    scores = jnp.einsum("bhw,bcw->bhc", q.astype(jnp.float32), rows, precision=_HIGHEST) * scale
    valid = jnp.arange(rows.shape[1])[None, :] < lengths[:, None]
    probs = jax.nn.softmax(jnp.where(valid[:, None, :], scores, _MASKED), axis=-1)
    out = jnp.einsum("bhc,bcr->bhr", probs, rows[..., :latent_dim], precision=_HIGHEST)
    return jnp.where((lengths > 0)[:, None, None], out, 0.0).astype(q.dtype)


def mla_prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    scale: float,
    latent_dim: int,
) -> jax.Array:
    """q [T, H, W] (ragged rows of S sequences) -> [T, H, latent_dim], causal over each
    sequence's history (every row scored against every sequence's rows and masked to its own, as
    `reference.prefill_attention`)."""
    t = q.shape[0]
    rows = _latent_pages(k_cache, v_cache, layer, block_tables, latent_dim)  # [S, C, W]
    s, c, w = rows.shape
    rows = rows.reshape(s * c, w)
    row_seq, row_pos, row_real = token_layout(query_start, seq_lens, t)
    key_seq, key_pos = jnp.repeat(jnp.arange(s), c), jnp.tile(jnp.arange(c), s)
    valid = (key_seq[None, :] == row_seq[:, None]) & (key_pos[None, :] <= row_pos[:, None]) & row_real[:, None]
    scores = jnp.einsum("thw,cw->thc", q.astype(jnp.float32), rows, precision=_HIGHEST) * scale
    probs = jax.nn.softmax(jnp.where(valid[:, None, :], scores, _MASKED), axis=-1)
    out = jnp.einsum("thc,cr->thr", probs, rows[:, :latent_dim], precision=_HIGHEST)
    return jnp.where(row_real[:, None, None], out, 0.0).astype(q.dtype)
