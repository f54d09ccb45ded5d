"""Pure-JAX paged attention: the `reference` backend and the oracle for the Pallas kernels.

Cache layout (DESIGN.md): K and V are each `[num_layers, num_kv_heads, num_blocks, block_size,
head_dim]`. The functions take the whole stacked cache and a layer index, so that a model that
scans over its layers never slices a layer out of the cache before a kernel call (a slice
passed to a custom call would be a copy of the whole layer pool).

The cache may be of any format of `kv_quant` (rows with scales for int8 and fp8); its values are
read as `kv_quant.dequantize` gives them.

Both functions expect the new tokens' K/V to be in the cache already (the model writes, then
attends), and neither applies anything but `scale` to the scores: no implicit 1/sqrt(d).

`sinks` [H] (optional, gpt-oss): a learned logit per query head that joins each softmax's
denominator and has no value, so a row's weights sum to less than one; without keys its row
is zeros, as without sinks.

Decode: one query token per sequence; `lengths[b]` counts the cached tokens including it.
Prefill (ragged): the flattened new tokens of several sequences. Sequence `s` owns query rows
`query_start[s]:query_start[s+1]`; its last new token sits at position `seq_lens[s] - 1`, so a
chunk that follows a cached history of `h` tokens has positions `h .. seq_lens[s] - 1`. Rows at
or past `query_start[-1]` are padding and come back as zeros, as do sequences of length 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import kv_quant

_MASKED = -1e30  # finite, so a fully masked (padding) row gives zeros rather than NaN
# f32 on a GPU would otherwise multiply in TF32 (~1e-3 relative): too loose for an oracle.
_HIGHEST = jax.lax.Precision.HIGHEST


def _softcap(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


def _softmax(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over the last axis; with `sinks` (broadcast against scores[..., :1]) a column of
    them joins the denominator and is dropped after."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    column = jnp.broadcast_to(sinks.astype(scores.dtype), (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]


def _gather_pages(cache: jax.Array, layer: jax.Array, block_tables: jax.Array) -> jax.Array:
    """[L, KVH, NB, BS, row] x [S, W] -> [KVH, S, W * BS, D] (the sequences' history, in order,
    its values as `kv_quant.dequantize` gives them)."""
    pages = kv_quant.dequantize(cache[layer][:, block_tables])  # [KVH, S, W, BS, D]
    kvh, s, w, bs, d = pages.shape
    return pages.reshape(kvh, s, w * bs, d)


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [B, H, D] -> [B, H, D]; sequence b attends to its first `lengths[b]` cached tokens."""
    b, h, d = q.shape
    kvh = k_cache.shape[1]
    k = _gather_pages(k_cache, layer, block_tables)  # [KVH, B, C, D]
    v = _gather_pages(v_cache, layer, block_tables)
    qg = q.reshape(b, kvh, h // kvh, d)
    scores = jnp.einsum("bkgd,kbcd->bkgc", qg, k, precision=_HIGHEST, preferred_element_type=jnp.float32) * scale
    scores = _softcap(scores, soft_cap)
    pos = jnp.arange(k.shape[2])[None, :]
    valid = pos < lengths[:, None]
    if sliding_window is not None:
        valid &= pos >= lengths[:, None] - sliding_window
    scores = jnp.where(valid[:, None, None, :], scores, _MASKED)
    probs = _softmax(scores, None if sinks is None else sinks.reshape(1, kvh, h // kvh, 1))
    out = jnp.einsum(
        "bkgc,kbcd->bkgd", probs.astype(v.dtype), v, precision=_HIGHEST, preferred_element_type=jnp.float32
    )
    out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out.reshape(b, h, d).astype(q.dtype)


def token_layout(
    query_start: jax.Array, seq_lens: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each flattened query row: its sequence, its absolute position, and whether it is real."""
    t = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(query_start, t, side="right") - 1, 0, seq_lens.shape[0] - 1)
    q_len = query_start[seq + 1] - query_start[seq]
    pos = seq_lens[seq] - q_len + (t - query_start[seq])
    real = t < query_start[-1]
    return seq, pos, real


def prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    visible_until: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [T, H, D] (ragged rows of S sequences) -> [T, H, D], causal over each sequence's history;
    with `visible_until` [T], row t attends to positions up to `visible_until[t]` instead of its
    own (the rows of an image attend to each other both ways; the window still ends at its own).

    Every row is scored against the history of every sequence of the batch and masked to its
    own: S-fold redundant work, which stays small because the scheduler caps the sequences of a
    prefill step. The Pallas kernel visits only the row's own blocks.
    """
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    k = _gather_pages(k_cache, layer, block_tables)  # [KVH, S, C, D]
    v = _gather_pages(v_cache, layer, block_tables)
    s, c = k.shape[1], k.shape[2]
    k = k.reshape(kvh, s * c, d)
    v = v.reshape(kvh, s * c, d)
    row_seq, row_pos, row_real = token_layout(query_start, seq_lens, t)
    key_seq = jnp.repeat(jnp.arange(s), c)
    key_pos = jnp.tile(jnp.arange(c), s)
    last = row_pos if visible_until is None else visible_until
    valid = (key_seq[None, :] == row_seq[:, None]) & (key_pos[None, :] <= last[:, None])
    if sliding_window is not None:
        valid &= key_pos[None, :] > row_pos[:, None] - sliding_window
    valid &= row_real[:, None]
    qg = q.reshape(t, kvh, h // kvh, d)
    # kv-head-major products: XLA:CPU has no bf16 x bf16 -> f32 dot for "tkgc,kcd->tkgd".
    scores = jnp.einsum("tkgd,kcd->ktgc", qg, k, precision=_HIGHEST, preferred_element_type=jnp.float32) * scale
    scores = _softcap(scores, soft_cap)
    scores = jnp.where(valid[None, :, None, :], scores, _MASKED)
    probs = _softmax(scores, None if sinks is None else sinks.reshape(kvh, 1, h // kvh, 1))
    out = jnp.einsum("ktgc,kcd->ktgd", probs.astype(v.dtype), v, precision=_HIGHEST, preferred_element_type=jnp.float32)
    out = out.transpose(1, 0, 2, 3)
    out = jnp.where(row_real[:, None, None, None], out, 0.0)
    return out.reshape(t, h, d).astype(q.dtype)
