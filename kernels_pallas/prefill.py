"""Ragged prefill paged attention in Pallas: chunks of several sequences over their paged K/V.

Same contract as `reference.prefill_attention` (see there), plus tuning knobs.

Work split. The flattened query rows are cut into tiles of `block_q` rows that never cross
a sequence boundary (a sequence of n new rows gets ceil(n / block_q) tiles), so each tile
belongs to one sequence and reads only that sequence's blocks. The tile -> (sequence, first
row, row count, first position) table is computed in plain JAX before the call (GPU Pallas
has no scalar prefetch, so the kernel reads it from an int32 ref). The grid is
(tile, kv_head); one program packs block_q rows x all query heads of its kv head into the
matmul's rows, walks the block table `pages_per_step` pages at a time up to the tile's last
position (so causal masking skips the future instead of computing it), and keeps an f32
online softmax. Tiles write a padded [tile, kv_head, block_q * group, D] buffer, from which
each real row is gathered back into [T, H, D]; padding rows come back as zeros. Attention
sinks (gpt-oss) start each row's online softmax (`common.SoftmaxState.start`).

The floor. Prefill is compute-bound once chunks are long: ~4 * T * ctx * H * D flops
(QK^T and PV, halved by causality within the chunk) against ~990 TFLOP/s dense bf16 on an
H200 (~790 measured for a plain matmul). For short chunks over a long history it is
memory-bound like decode: the K/V bytes of each tile's history, read once per tile,
divided by HBM bandwidth (~4.3 TB/s measured copy), with block_q setting the reuse.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import common, kv_quant

TARGET_ROWS = 64  # block_q * padded group, per program
TOKENS_PER_STEP = 64


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    scale: float
    soft_cap: float | None
    sliding_window: int | None
    block_q: int
    pages_per_step: int
    num_warps: int
    num_stages: int
    interpret: bool
    sinks: bool = False  # a sinks input [KVH, block_q * Gp] follows v (each row's head's)


def default_block_q(num_tokens: int, padded_group: int) -> int:
    """Rows per tile: ~64 matmul rows, >= 16, and no longer than the flattened batch."""
    block_q = max(1, TARGET_ROWS // padded_group)
    block_q = min(block_q, common.next_power_of_2(num_tokens))
    return max(block_q, common.next_power_of_2(common.cdiv(16, padded_group)))


def default_pages_per_step(block_size: int, table_width: int) -> int:
    pages = max(1, TOKENS_PER_STEP // block_size)
    pages = min(pages, common.next_power_of_2(table_width))
    return max(pages, common.next_power_of_2(common.cdiv(16, block_size)))


def _prefill_kernel(
    layer_ref,
    tiles_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    cfg: PrefillConfig,
    block_size: int,
):
    sinks_ref, o_ref = refs if cfg.sinks else (None, *refs)
    tile, h = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    seq = tiles_ref[tile, 0]
    first_row = tiles_ref[tile, 1]
    num_rows = tiles_ref[tile, 2]
    first_pos = tiles_ref[tile, 3]
    q = q_ref[pl.ds(first_row, cfg.block_q), h]  # [block_q, Gp, D]
    block_q, group, head_dim = q.shape
    rows = block_q * group
    q = q.reshape(rows, head_dim)
    row = jnp.arange(rows) // group
    pos = first_pos + row
    row_real = row < num_rows

    pages_per_step = cfg.pages_per_step
    tokens_per_step = pages_per_step * block_size
    num_keys = jnp.where(num_rows > 0, first_pos + num_rows, 0)  # keys up to the last row
    num_pages = common.cdiv(num_keys, block_size)
    step_hi = common.cdiv(num_pages, pages_per_step)
    step_lo = 0
    if cfg.sliding_window is not None:
        step_lo = jnp.maximum(first_pos - cfg.sliding_window + 1, 0) // tokens_per_step

    def body(i, state):
        page0 = i * pages_per_step
        pages = tables_ref[seq, pl.ds(page0, pages_per_step)]
        pages = jnp.where(page0 + jnp.arange(pages_per_step) < num_pages, pages, 0)
        k = common.load_pages(k_ref, layer, h, pages, head_dim)
        v = common.load_pages(v_ref, layer, h, pages, head_dim)
        key = page0 * block_size + jnp.arange(tokens_per_step)
        valid = (key[None, :] <= pos[:, None]) & row_real[:, None]
        if cfg.sliding_window is not None:
            valid &= key[None, :] > pos[:, None] - cfg.sliding_window
        return common.attend_step(state, q, k, v, valid, scale=cfg.scale, soft_cap=cfg.soft_cap)

    sinks = None if sinks_ref is None else sinks_ref[h]  # [rows]
    state = jax.lax.fori_loop(step_lo, step_hi, body, common.SoftmaxState.start(rows, head_dim, sinks))
    o_ref[tile, h] = state.normalized().astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prefill(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start, sinks, cfg: PrefillConfig):
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    padded_group = common.next_power_of_2(group)
    block_q = cfg.block_q
    num_tiles = common.cdiv(num_tokens, block_q) + num_seqs

    width = common.cdiv(block_tables.shape[1], cfg.pages_per_step) * cfg.pages_per_step
    tables = common.pad_block_table(block_tables, width)
    qg = common.group_queries(q, num_kv_heads, padded_group, kv_quant.value_dtype(k_cache.dtype))
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, 0), (0, 0)))  # a tile may start near the end
    tiles = common.tile_layout(query_start, seq_lens, num_tiles, block_q)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    # A tile's rows are (row, query head) pairs: its kv head's sinks, once per row.
    extra = () if sinks is None else (jnp.tile(common.grouped_sinks(sinks, num_kv_heads, padded_group), (1, block_q)),)

    kernel = common.fresh_kernel(_prefill_kernel, cfg=cfg, block_size=block_size)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, block_q * padded_group, head_dim), q.dtype),
        grid=(num_tiles, num_kv_heads),
        interpret=cfg.interpret,
        compiler_params=common.compiler_params(cfg.interpret, cfg.num_warps, cfg.num_stages),
        name=f"paged_prefill_g{group}_bs{block_size}_q{block_q}_p{cfg.pages_per_step}",
    )(layer, tiles, tables, qg, k_cache, v_cache, *extra)

    out = out.reshape(num_tiles, num_kv_heads, block_q, padded_group, head_dim)
    tile, offset, real = common.row_to_tile(query_start, num_tokens, block_q)
    rows = out[tile, :, offset, :group]  # [T, KVH, G, D]
    rows = jnp.where(real[:, None, None, None], rows, jnp.zeros((), rows.dtype))
    return rows.reshape(num_tokens, num_heads, head_dim)


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
    interpret: bool | None = None,
    block_q: int | None = None,
    pages_per_step: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """q [T, H, D] (ragged rows of S sequences) -> [T, H, D]; see `reference.prefill_attention`.

    interpret: None = on when JAX's default backend is CPU (or as $JAXSERVE_PALLAS_INTERPRET
    says). block_q and pages_per_step (powers of two) default to per-shape heuristics.
    """
    interpret = common.resolve_interpret(interpret)
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    padded_group = common.next_power_of_2(num_heads // num_kv_heads)
    if block_q is None:
        block_q = default_block_q(num_tokens, padded_group)
    if pages_per_step is None:
        pages_per_step = default_pages_per_step(block_size, block_tables.shape[1])
    for name, n in (("block_q", block_q), ("pages_per_step", pages_per_step)):
        if n < 1 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two, got {n}")
    common.check_native_shapes(head_dim, block_size, pages_per_step * block_size, interpret)
    if not interpret and block_q * padded_group < 16:
        raise ValueError(f"block_q * padded group must be >= 16 on GPU, got {block_q * padded_group}")
    cfg = PrefillConfig(
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        block_q=int(block_q),
        pages_per_step=int(pages_per_step),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        sinks=sinks is not None,
    )
    return _prefill(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start, sinks, cfg)
