"""Decode multi-head latent attention (MLA, absorbed form) in Pallas (Triton): one query token
per sequence, every head against the sequence's paged latent rows.

Same contract as `mla_reference.mla_decode_attention` (see there for the cache layout), plus
tuning knobs. The queries arrive in latent space, [q_latent | q_pe] per head (W values); the
wrapper splits them as the rows are split (`split_latent`), so a score is the sum of four
products of pieces that are each a power of two wide where the ranks are (DeepSeek-V3: c_kv
halves of 256, k_pe halves of 32): q.c_kv over both K and V halves plus q_pe.k_pe over both.
The output accumulates p.c_kv in two halves of `latent_dim / 2` and is written as one row.

Work split. The grid is (batch, head block, split): a program takes `heads_per_program` query
heads (padded to 16 rows at least for the tensor-core matmul) and walks its sequence's block
table `pages_per_step` pages at a time with an online softmax in f32; with few programs the
table is cut into `num_splits` ranges whose partials a log-sum-exp merge combines, as
`decode.py` does. Every head block streams the sequence's latents again: with DeepSeek-V3's 128
heads in blocks of 16 that is 8 reads of 576 values per token, against 128 heads x 2 x 128 of
decompressed K and V (the latent's point); a kernel taking all heads at once (FlashMLA's 64-row
warpgroup tiles) would read them once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import common, kv_quant
from kernels_pallas.decode import MIN_ROWS, default_num_splits
from kernels_pallas.mla_reference import split_latent

TOKENS_PER_STEP = 32  # a step's latent tiles: 32 x 288 values of K and of V


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig:
    scale: float
    latent_dim: int
    pages_per_step: int
    num_splits: int
    num_warps: int
    num_stages: int
    interpret: bool


class _State(NamedTuple):
    m: jax.Array  # [M] running max
    l: jax.Array  # [M] running denominator
    acc_k: jax.Array  # [M, r / 2] p . c_kv's first half (in K)
    acc_v: jax.Array  # [M, r / 2] its second half (in V)


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    dims = (((1,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _pieces(ref, layer, pages, half_c: int, half_pe: int) -> tuple[jax.Array, jax.Array]:
    """One half's c_kv and k_pe pieces of pages [P] -> [P * BS, half_c], [P * BS, half_pe]."""
    c = ref[layer, 0, pages, :, pl.ds(0, half_c)]
    pe = ref[layer, 0, pages, :, pl.ds(half_c, half_pe)]
    p, bs = c.shape[:2]
    return c.reshape(p * bs, half_c), pe.reshape(p * bs, half_pe)


def _mla_decode_kernel(
    layer_ref,
    lengths_ref,
    tables_ref,
    qk_ref,
    qv_ref,
    k_ref,
    v_ref,
    *out_refs,
    cfg: MlaDecodeConfig,
    block_size: int,
    pages_per_split: int,
):
    b, hb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, length = layer_ref[0], lengths_ref[b]
    half_c = cfg.latent_dim // 2
    rows, half_pe = qk_ref.shape[2], qk_ref.shape[3] - half_c
    q_pieces = tuple(  # loaded apart: Triton takes power-of-two blocks only (256 and 32, not 288)
        ref[b, hb, :, pl.ds(start, size)]
        for ref in (qk_ref, qv_ref)
        for start, size in ((0, half_c), (half_c, half_pe))
    )
    tokens_per_step = cfg.pages_per_step * block_size
    num_pages = common.cdiv(length, block_size)
    first = split * pages_per_split
    last = jnp.minimum(first + pages_per_split, num_pages)

    def body(i, state: _State) -> _State:
        page0 = first + i * cfg.pages_per_step
        pages = tables_ref[b, pl.ds(page0, cfg.pages_per_step)]
        pages = jnp.where(page0 + jnp.arange(cfg.pages_per_step) < num_pages, pages, 0)
        kc, kp = _pieces(k_ref, layer, pages, half_c, half_pe)
        vc, vp = _pieces(v_ref, layer, pages, half_c, half_pe)
        s = sum(_dot(q, piece, 1) for q, piece in zip(q_pieces, (kc, kp, vc, vp))) * cfg.scale
        valid = jnp.broadcast_to((page0 * block_size + jnp.arange(tokens_per_step) < length)[None, :], s.shape)
        s = jnp.where(valid, s, common.MASKED)
        m_new = jnp.maximum(state.m, jnp.max(s, axis=1))
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(state.m - m_new)
        l_new = alpha * state.l + jnp.sum(p, axis=1)
        p = p.astype(kc.dtype)
        return _State(
            m_new, l_new, alpha[:, None] * state.acc_k + _dot(p, kc, 0), alpha[:, None] * state.acc_v + _dot(p, vc, 0)
        )

    empty = _State(
        jnp.full((rows,), common.MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, half_c), jnp.float32),
        jnp.zeros((rows, half_c), jnp.float32),
    )
    steps = jnp.maximum(common.cdiv(last - first, cfg.pages_per_step), 0)
    state = jax.lax.fori_loop(0, steps, body, empty)
    if cfg.num_splits == 1:
        (o_ref,) = out_refs
        denom = jnp.where(state.l == 0.0, 1.0, state.l)[:, None]
        o_ref[b, hb, :, pl.ds(0, half_c)] = (state.acc_k / denom).astype(o_ref.dtype)
        o_ref[b, hb, :, pl.ds(half_c, half_c)] = (state.acc_v / denom).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[split, b, hb, :, pl.ds(0, half_c)] = state.acc_k
        o_ref[split, b, hb, :, pl.ds(half_c, half_c)] = state.acc_v
        m_ref[split, b, hb] = state.m
        l_ref[split, b, hb] = state.l


def _grouped(q: jax.Array, rows: int, dtype) -> jax.Array:
    """[B, H, X] -> [B, ceil(H / rows), rows, X] in `dtype`, the heads zero-padded."""
    batch, heads, width = q.shape
    blocks = common.cdiv(heads, rows)
    q = jnp.pad(q.astype(dtype), ((0, 0), (0, blocks * rows - heads), (0, 0)))
    return q.reshape(batch, blocks, rows, width)


@functools.partial(jax.jit, static_argnames=("cfg", "rows"))
def _mla_decode(q, k_cache, v_cache, layer, block_tables, lengths, cfg: MlaDecodeConfig, rows: int):
    batch, num_heads, _ = q.shape
    block_size = k_cache.shape[3]
    steps = common.cdiv(block_tables.shape[1], cfg.pages_per_step)
    pages_per_split = common.cdiv(steps, cfg.num_splits) * cfg.pages_per_step
    tables = common.pad_block_table(block_tables, cfg.num_splits * pages_per_split)
    dtype = kv_quant.value_dtype(k_cache.dtype)
    q_k, q_v = (_grouped(x, rows, dtype) for x in split_latent(q, cfg.latent_dim))
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    grid = (batch, q_k.shape[1], rows)
    if cfg.num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((*grid, cfg.latent_dim), q.dtype)
    else:
        parts = (cfg.num_splits, *grid)
        out_shape = (
            jax.ShapeDtypeStruct((*parts, cfg.latent_dim), jnp.float32),
            jax.ShapeDtypeStruct(parts, jnp.float32),
            jax.ShapeDtypeStruct(parts, jnp.float32),
        )
    kernel = common.fresh_kernel(_mla_decode_kernel, cfg=cfg, block_size=block_size, pages_per_split=pages_per_split)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(batch, q_k.shape[1], cfg.num_splits),
        interpret=cfg.interpret,
        compiler_params=common.compiler_params(cfg.interpret, cfg.num_warps, cfg.num_stages),
        name=f"paged_mla_decode_h{rows}_bs{block_size}_p{cfg.pages_per_step}_s{cfg.num_splits}",
    )(layer, lengths.astype(jnp.int32), tables, q_k, q_v, k_cache, v_cache)
    if cfg.num_splits > 1:
        out = common.merge_splits(*out)
    return out.reshape(batch, -1, cfg.latent_dim)[:, :num_heads].astype(q.dtype)


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
    interpret: bool | None = None,
    heads_per_program: int = MIN_ROWS,
    pages_per_step: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """q [B, H, W] -> [B, H, latent_dim]; see `mla_reference.mla_decode_attention`.

    interpret: None = on when JAX's default backend is CPU (or as $JAXSERVE_PALLAS_INTERPRET
    says). heads_per_program: query heads per program (a power of two; at least 16 rows are
    computed). pages_per_step (a power of two; default ~32 tokens) and num_splits default to
    per-shape heuristics; num_warps / num_stages are Triton launch settings, untuned (no GPU
    measured them yet)."""
    interpret = common.resolve_interpret(interpret)
    if kv_quant.is_scaled(k_cache.dtype):
        raise ValueError("the MLA decode kernel reads unscaled latent caches only (no int8 / fp8)")
    batch, num_heads, width = q.shape
    block_size, table_width = k_cache.shape[3], block_tables.shape[1]
    if pages_per_step is None:
        pages_per_step = max(1, min(TOKENS_PER_STEP // block_size, common.next_power_of_2(table_width)))
    if pages_per_step & (pages_per_step - 1) or heads_per_program & (heads_per_program - 1):
        raise ValueError(f"pages_per_step {pages_per_step} and heads_per_program {heads_per_program}: powers of two")
    for n in (latent_dim // 2, (width - latent_dim) // 2):
        common.check_native_shapes(n, block_size, pages_per_step * block_size, interpret)
    rows = max(min(common.next_power_of_2(num_heads), heads_per_program), MIN_ROWS)
    if num_splits is None:
        steps = common.cdiv(table_width, pages_per_step)
        num_splits = default_num_splits(batch, common.cdiv(num_heads, rows), steps)
    cfg = MlaDecodeConfig(
        float(scale), int(latent_dim), int(pages_per_step), max(1, int(num_splits)), num_warps, num_stages, interpret
    )
    return _mla_decode(q, k_cache, v_cache, layer, block_tables, lengths, cfg, rows)
