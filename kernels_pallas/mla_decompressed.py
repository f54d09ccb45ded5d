"""Pure-JAX prefill of multi-head latent attention (MLA) by decompression: the latent rows a chunk
attends to are taken out of latent space into per-head keys and values, then plain causal attention.

The cache is `mla_reference`'s (one latent row [c_kv | k_pe] per token, in K and V halves). For
each gathered row, `kv_b_proj` [r, H, nope + v] gives its per-head k_nope (c_kv W_uk) and value
(c_kv W_uv); its key is [k_nope | k_pe], k_pe broadcast to every head. The decompressed keys and
values are transient (built in the step, never cached) and head-major, [H, keys, d]: one batched
matmul per head for the scores and one for the output (on CPU at DeepSeek-V3's shapes, scoring
k_nope and k_pe apart in key-major order was up to 1.3x slower: docs/performance.md). A plain
JAX/XLA program, so it lowers on every platform (CUDA included). When it is preferred to the
absorbed form: `jaxserve.model.latent_attention.decompresses`.

Conventions are `reference.prefill_attention`'s (lengths count the new tokens, whose latents are
in the cache already; every row is scored against every sequence's rows and masked to its own;
padding rows come back as zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.mla_reference import _latent_pages
from kernels_pallas.reference import _HIGHEST, _MASKED, token_layout


def mla_decompressed_prefill(
    q_nope: jax.Array,
    q_pe: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    kv_b: jax.Array,
    *,
    scale: float,
) -> jax.Array:
    """q_nope [T, H, nope], rotated q_pe [T, H, rope] (ragged rows of S sequences) and `kv_b_proj`
    as kv_b [r, H, nope + v] (per head: W_uk, then W_uv) -> f32 [T, H, v], causal over each
    sequence's history. The decompression runs in kv_b's dtype with f32 accumulation, as
    `kv_b_proj` applied to c_kv does in the checkpoint's own model."""
    t, nope = q_nope.shape[0], q_nope.shape[-1]
    r, heads = kv_b.shape[:2]
    rows = _latent_pages(k_cache, v_cache, layer, block_tables, r)  # [S, C, r + rope]
    s, c, w = rows.shape
    rows = rows.reshape(s * c, w)
    kv = jnp.einsum("cr,rhd->hcd", rows[:, :r].astype(kv_b.dtype), kv_b, preferred_element_type=jnp.float32)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(rows[None, :, r:], (heads, s * c, w - r))], axis=-1)
    q = jnp.concatenate([q_nope, q_pe], axis=-1).astype(jnp.float32)
    scores = jnp.einsum("thd,hcd->htc", q, k, precision=_HIGHEST) * scale
    row_seq, row_pos, row_real = token_layout(query_start, seq_lens, t)
    key_seq, key_pos = jnp.repeat(jnp.arange(s), c), jnp.tile(jnp.arange(c), s)
    valid = (key_seq[None, :] == row_seq[:, None]) & (key_pos[None, :] <= row_pos[:, None]) & row_real[:, None]
    probs = jax.nn.softmax(jnp.where(valid[None], scores, _MASKED), axis=-1)
    out = jnp.einsum("htc,hcv->thv", probs, kv[..., nope:], precision=_HIGHEST)
    return jnp.where(row_real[:, None, None], out, 0.0)
