"""Pure-JAX paged attention: the `reference` backend and the oracle for the Pallas kernels.

Cache layout (DESIGN.md): K and V are each `[num_layers, num_kv_heads, num_blocks, block_size,
head_dim]`. The functions take the whole stacked cache and a layer index, so that a model that
scans over its layers never slices a layer out of the cache before a kernel call (a slice
passed to a custom call would be a copy of the whole layer pool).

Both functions expect the new tokens' K/V to be in the cache already (the model writes, then
attends), and neither applies anything but `scale` to the scores: no implicit 1/sqrt(d).

Decode: one query token per sequence; `lengths[b]` counts the cached tokens including it.
Prefill (ragged): the flattened new tokens of several sequences. Sequence `s` owns query rows
`query_start[s]:query_start[s+1]`; its last new token sits at position `seq_lens[s] - 1`, so a
chunk that follows a cached history of `h` tokens has positions `h .. seq_lens[s] - 1`. Rows at
or past `query_start[-1]` are padding and come back as zeros, as do sequences of length 0.

How the work is split (XLA:CPU is the platform this backend serves; there a dense masked
product of every row with every sequence's whole table cost S-fold, and the gathered copy of
all tables made decode at batch 64 memory-bound on bytes it did not need). Rows are cut into
tiles that never cross a sequence boundary: tiles of TILE_ROWS rows for sequences with more
than SMALL_ROWS new rows, single-row tiles for the others (decode rows). A loop visits only
the tiles in use; a tile reads only its own sequence's pages, KEY_CHUNK keys at a time, and
only up to its last row's position (from the sliding window's start), folding them into an
f32 online softmax (`common.attend_step`, which the Pallas kernels share). So the work is
about the rows times their own causal history. Tiles write their whole row span from their
first row on, big tiles in row order and single rows last, so surplus rows are overwritten by
their owners, and padding rows are zeroed at the end.

Decode is the same computation with one row per sequence (`query_start = arange(B + 1)`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import common

TILE_ROWS = 128  # query rows per tile of a long chunk
SMALL_ROWS = 8  # sequences with at most this many new rows get single-row tiles
KEY_CHUNK = 128  # keys per step of a tile's loop (128 beat 256 and 512 on XLA:CPU: bench/attention_cpu.py)


def _chunk_kv(cache: jax.Array, layer: jax.Array, ids: jax.Array) -> jax.Array:
    """Pages `ids` [P] of one layer -> f32 [KVH, P * BS, D]. Indexed from the whole cache:
    slicing the layer out first could copy its pool in a loop."""
    pages = cache[layer, :, ids]  # [P, KVH, BS, D] (the advanced indices go first)
    p, kvh, bs, d = pages.shape
    return pages.transpose(1, 0, 2, 3).reshape(kvh, p * bs, d).astype(jnp.float32)


def _big_tiles(q_len: jax.Array, query_start: jax.Array, first_pos: jax.Array, num_tiles: int,
               block_q: int) -> tuple[jax.Array, jax.Array]:
    """[num_tiles, 4] int32 (sequence, first row, rows, first row's position) covering the rows
    of the sequences with q_len > 0 in tiles of block_q rows, and how many tiles are used."""
    tiles = common.cdiv(q_len, block_q)
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), q_len.shape[0] - 1)
    local = (t - (tile_end - tiles)[seq]) * block_q
    table = jnp.stack([seq, query_start[seq] + local, jnp.clip(q_len[seq] - local, 0, block_q),
                       first_pos[seq] + local], axis=1)
    return table.astype(jnp.int32), tile_end[-1]


def _row_tiles(small: jax.Array, query_start: jax.Array, first_pos: jax.Array,
               num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """[T, 4] single-row tiles for the real rows of the `small` sequences, and their count."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start, t, side="right") - 1, 0, small.shape[0] - 1)
    take = small[seq] & (t < query_start[-1])
    (rows,) = jnp.nonzero(take, size=num_tokens, fill_value=0)
    seq = seq[rows]
    table = jnp.stack([seq, rows, jnp.ones_like(rows), first_pos[seq] + rows - query_start[seq]], axis=1)
    return table.astype(jnp.int32), jnp.sum(take)


def _attend_tiles(out, tiles, count, block_q, q, k_cache, v_cache, layer, tables, *, scale,
                  soft_cap, sliding_window):
    """Run the first `count` tiles of `tiles` (block_q rows each) and write them into out."""
    _, kvh, group, d = q.shape
    pages = max(1, min(KEY_CHUNK // k_cache.shape[3], tables.shape[1]))
    chunk = pages * k_cache.shape[3]
    width = common.cdiv(tables.shape[1], pages) * pages
    tables = common.pad_block_table(tables, width)
    row_offset = jnp.repeat(jnp.arange(block_q), group)  # tile row of each of the Bq * G rows
    attend = jax.vmap(functools.partial(common.attend_step, scale=scale, soft_cap=soft_cap),
                      in_axes=(0, 0, 0, 0, None))

    def tile_body(i, out):
        seq, first_row, num_rows, first_pos = tiles[i, 0], tiles[i, 1], tiles[i, 2], tiles[i, 3]
        qt = lax.dynamic_slice_in_dim(q, first_row, block_q, axis=0)  # [Bq, KVH, G, D]
        qt = qt.transpose(1, 0, 2, 3).reshape(kvh, block_q * group, d)
        pos = first_pos + row_offset
        lo = 0
        if sliding_window is not None:
            lo = jnp.maximum(first_pos - sliding_window + 1, 0) // chunk
        hi = common.cdiv(jnp.maximum(first_pos + num_rows, 0), chunk)

        def chunk_body(j, state):
            ids = lax.dynamic_slice_in_dim(tables[seq], j * pages, pages)
            key = j * chunk + jnp.arange(chunk)
            valid = key[None, :] <= pos[:, None]
            if sliding_window is not None:
                valid &= key[None, :] > pos[:, None] - sliding_window
            return attend(state, qt, _chunk_kv(k_cache, layer, ids), _chunk_kv(v_cache, layer, ids), valid)

        empty = common.SoftmaxState.empty(block_q * group, d)
        empty = jax.tree.map(lambda x: jnp.broadcast_to(x, (kvh, *x.shape)), empty)
        state = lax.fori_loop(lo, hi, chunk_body, empty)
        rows = jax.vmap(common.SoftmaxState.normalized)(state)  # [KVH, Bq * G, D]
        rows = rows.reshape(kvh, block_q, group, d).transpose(1, 0, 2, 3)
        return lax.dynamic_update_slice_in_dim(out, rows, first_row, axis=0)

    return lax.fori_loop(0, count, tile_body, out)


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
) -> jax.Array:
    """q [T, H, D] (ragged rows of S sequences) -> [T, H, D], causal over each sequence's history
    (the tiling: see the module docstring)."""
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    query_start = query_start.astype(jnp.int32)
    q_len = query_start[1:] - query_start[:-1]
    first_pos = seq_lens.astype(jnp.int32) - q_len
    small = (q_len > 0) & (q_len <= SMALL_ROWS)
    block_q = min(TILE_ROWS, t)
    big, num_big = _big_tiles(jnp.where(small, 0, q_len), query_start, first_pos,
                              common.cdiv(t, block_q) + seq_lens.shape[0], block_q)
    singles, num_singles = _row_tiles(small, query_start, first_pos, t)

    # Padded by a tile, so that a tile starting near the end still slices block_q rows.
    qg = jnp.pad(q.astype(jnp.float32).reshape(t, kvh, h // kvh, d), ((0, block_q), (0, 0), (0, 0), (0, 0)))
    out = jnp.zeros_like(qg)
    run = functools.partial(_attend_tiles, q=qg, k_cache=k_cache, v_cache=v_cache, layer=layer,
                            tables=block_tables, scale=scale, soft_cap=soft_cap,
                            sliding_window=sliding_window)
    out = run(out, big, num_big, block_q)
    out = run(out, singles, num_singles, 1)
    real = jnp.arange(t) < query_start[-1]
    out = jnp.where(real[:, None, None, None], out[:t], 0.0)
    return out.reshape(t, h, d).astype(q.dtype)


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
) -> jax.Array:
    """q [B, H, D] -> [B, H, D]; sequence b attends to its first `lengths[b]` cached tokens
    (length 0: a padding entry, zeros)."""
    query_start = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return prefill_attention(q, k_cache, v_cache, layer, block_tables, lengths, query_start,
                             scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
