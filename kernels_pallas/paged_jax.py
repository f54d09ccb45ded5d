"""Paged attention in plain JAX that reads only what the sequences hold (the `jax` backend; the
CPU default, `cpu`, runs C++ kernels with the same contracts, `cpu_attention`).

Same contracts as `reference.decode_attention` and `reference.prefill_attention` (a cache of any
`kv_quant` format, read through `kv_quant.dequantize` a step of pages at a time). The
reference gathers every sequence's whole block table (the step's width bucket) and scores
every query row against it, and its ragged prefill scores each row against every sequence
of the step; on XLA:CPU that made attention most of a step's time (a batch-64 decode at a
128-page width: ~180 ms per layer, where its K/V are ~50 MB). This backend does what the
Pallas kernels do, in XLA:

- query rows are cut into tiles that never cross a sequence (a decode row is a tile of one
  row; a prefill chunk of n rows is ceil(n / block_q) tiles), so a tile reads only its own
  sequence's pages;
- tiles go in groups; each group's `fori_loop` walks its block tables a few pages at a time,
  with the kernels' f32 online softmax (`common.attend_step`), and stops at the group's last
  key: the work follows the sequences' lengths, not the width of the block tables (so a wide
  table costs almost nothing), and groups after the last real tile cost nothing.

The floor is the same as the kernels': K/V bytes read once per tile over memory bandwidth
for decode, QK^T and PV flops for long prefill chunks (`bench.attention_cpu` reports both).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import common, kv_quant

BLOCK_Q = 64  # prefill rows per tile
GROUP_ROWS = 256  # prefill query rows (tiles x rows per tile) that walk the pages together
PREFILL_TOKENS_PER_STEP = 64  # keys per loop step of a prefill group
# Decode: rows (tiles of one row) that walk the pages together, DECODE_TOKENS_PER_STEP keys at a
# time. A group walks to its longest sequence and reads pages for all its rows, so padding rows
# (length 0) cost nothing only in whole groups of them. Measured on XLA:CPU at the default
# model's shapes (per layer, against 256 rows x 32 keys before): 8 x 128 costs the same or less
# for full batches of 1-64 rows at 200-2,000 tokens of history, and 6x less for a batch of 64
# with 8 real rows (a mixed step's decode part, or a decode bucket's padding).
DECODE_GROUP_ROWS = 8
DECODE_TOKENS_PER_STEP = 128


def attend_tiles(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    tables: jax.Array,
    first_pos: jax.Array,
    num_rows: jax.Array,
    *,
    tokens_per_step: int,
    group_tiles: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of query tiles over their sequences' pages.

    q [N, Q, KVH, G, D]: tile n's row i sits at position `first_pos[n] + i` of the sequence
    whose pages are `tables[n]` [W], and is real for i < `num_rows[n]`; sinks [H] (optional):
    each query head's attention sink. Returns f32 [N, Q, KVH, G, D], zeros for rows that are
    not real.

    Tiles go in groups of `group_tiles`; each group walks the pages from its first key in its
    window to its own last key, `tokens_per_step` keys at a time, so groups after the last real
    tile cost nothing and a chunk's early rows stop early (causality).
    """
    n, bq, kvh, g, d = q.shape
    bs = k_cache.shape[3]
    group = max(1, min(n, group_tiles))
    pad = common.cdiv(n, group) * group - n
    tokens = max(bs, min(tokens_per_step, common.next_power_of_2(tables.shape[1]) * bs) // bs * bs)
    pages_per_step = tokens // bs
    tables = common.pad_block_table(tables, common.cdiv(tables.shape[1], pages_per_step) * pages_per_step)
    tables = jnp.pad(tables, ((0, pad), (0, 0)))
    first_pos, num_rows = jnp.pad(first_pos, (0, pad)), jnp.pad(num_rows, (0, pad))
    # Rows of a tile and kv head side by side: q [N, KVH, Q * G, D], so each product is a
    # batched matmul with its batch axes (tile, kv head) leading in every operand.
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0), (0, 0))).transpose(0, 2, 1, 3, 4).reshape(n + pad, kvh, bq * g, d)
    pos = first_pos[:, None] + jnp.arange(bq)  # [N, Q]
    real = jnp.arange(bq)[None, :] < num_rows[:, None]
    row_pos = jnp.repeat(pos, g, axis=1)[:, :, None]  # [N, Q * G, 1]
    row_real = jnp.repeat(real, g, axis=1)[:, :, None]
    num_keys = jnp.where(num_rows > 0, first_pos + num_rows, 0)
    heads = jnp.arange(kvh)[None, :, None]
    key_offsets = jnp.arange(tokens)
    rows = bq * g
    # The Pallas kernels' online-softmax step, per (tile, kv head); the mask is shared by kv heads.
    attend = jax.vmap(
        jax.vmap(functools.partial(common.attend_step, scale=scale, soft_cap=soft_cap), in_axes=(0, 0, 0, 0, None))
    )
    if sinks is None:
        start = jax.vmap(jax.vmap(lambda _: common.SoftmaxState.empty(rows, d)))(jnp.zeros((group, kvh)))
    else:  # the rows of a (tile, kv head) are (row, query head) pairs: the group's sinks per row
        row_sinks = jnp.tile(sinks.astype(jnp.float32).reshape(kvh, g), (1, bq))
        start = common.SoftmaxState.start(rows, d, jnp.broadcast_to(row_sinks, (group, kvh, rows)))

    def group_body(gi, out):
        take = lambda x: lax.dynamic_slice_in_dim(x, gi * group, group, axis=0)  # noqa: E731
        q_g, tables_g, pos_g, real_g = take(q), take(tables), take(row_pos), take(row_real)
        step_hi = common.cdiv(jnp.max(take(num_keys)), tokens)
        step_lo = 0
        if sliding_window is not None:  # from the group's first key in a window
            first_key = jnp.where(
                num_rows > 0, jnp.maximum(first_pos - sliding_window + 1, 0), jnp.iinfo(jnp.int32).max
            )
            step_lo = jnp.minimum(jnp.min(take(first_key)) // tokens, step_hi)

        def body(i, state):
            pages = lax.dynamic_slice_in_dim(tables_g, i * pages_per_step, pages_per_step, axis=1)
            k = kv_quant.dequantize(k_cache[layer, heads, pages[:, None, :]]).reshape(group, kvh, tokens, d)
            v = kv_quant.dequantize(v_cache[layer, heads, pages[:, None, :]]).reshape(group, kvh, tokens, d)
            key = (i * tokens + key_offsets)[None, None, :]
            valid = (key <= pos_g) & real_g  # [group, Q * G, tokens]
            if sliding_window is not None:
                valid &= key > pos_g - sliding_window
            return attend(state, q_g, k, v, valid)

        state = lax.fori_loop(step_lo, step_hi, body, start)
        return lax.dynamic_update_slice_in_dim(out, state.normalized(), gi * group, axis=0)

    last_real = jnp.max(jnp.where(num_rows > 0, jnp.arange(n + pad), -1))
    out = lax.fori_loop(0, (last_real + group) // group, group_body, jnp.zeros((n + pad, kvh, rows, d), jnp.float32))
    return out[:n].reshape(n, kvh, bq, g, d).transpose(0, 2, 1, 3, 4)


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
    lengths = lengths.astype(jnp.int32)
    out = attend_tiles(
        q.reshape(b, 1, kvh, h // kvh, d),
        k_cache,
        v_cache,
        layer,
        block_tables.astype(jnp.int32),
        jnp.maximum(lengths - 1, 0),
        (lengths > 0).astype(jnp.int32),
        tokens_per_step=DECODE_TOKENS_PER_STEP,
        group_tiles=DECODE_GROUP_ROWS,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        sinks=sinks,
    )
    return out.reshape(b, h, d).astype(q.dtype)


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
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [T, H, D] (ragged rows of S sequences) -> [T, H, D], causal over each sequence's history."""
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    block_q = min(BLOCK_Q, common.next_power_of_2(t))
    num_tiles = common.cdiv(t, block_q) + seq_lens.shape[0]
    tiles = common.tile_layout(query_start, seq_lens, num_tiles, block_q)  # seq, first row, rows, first pos
    padded = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))  # a tile may start near the end
    rows = tiles[:, 1:2] + jnp.arange(block_q)  # [N, Q]
    qt = padded[rows].reshape(num_tiles, block_q, kvh, h // kvh, d)
    out = attend_tiles(
        qt,
        k_cache,
        v_cache,
        layer,
        block_tables.astype(jnp.int32)[tiles[:, 0]],
        tiles[:, 3],
        tiles[:, 2],
        tokens_per_step=PREFILL_TOKENS_PER_STEP,
        group_tiles=GROUP_ROWS // block_q,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        sinks=sinks,
    )
    tile, offset, real = common.row_to_tile(query_start, t, block_q)
    out = jnp.where(real[:, None, None, None], out[tile, offset], 0.0)  # [T, KVH, G, D]
    return out.reshape(t, h, d).astype(q.dtype)
