"""Decode paged attention in Pallas: one query token per sequence over its paged K/V.

Same contract as `reference.decode_attention` (see there), plus tuning knobs.

Work split. The grid is (batch, kv_head, split). One program takes all query heads of one
kv head (GQA packing: the K/V pages it reads serve every query head of the group, so each
byte of K/V is read once per step, not once per query head), zero-padded to at least 16
rows for the tensor-core matmul. It walks its sequence's block table `pages_per_step`
pages at a time, gathering those pages by block id, with an online softmax in f32.
When batch x kv_heads is too small to fill the GPU, the block table is cut into
`num_splits` contiguous ranges handled by separate programs (flash-decoding); each writes
its unnormalized output with its running max and denominator, and a log-sum-exp merge in
plain JAX combines them (a few KB per sequence, cheap next to the K/V stream). Attention sinks
(gpt-oss) join in that merge, so with sinks even one split writes its partials.

The floor. Decode attention is memory-bound: every program streams its K and V pages once
and does ~4 * group flops per byte. So

    time >= K/V bytes read / HBM bandwidth
         = 2 * sum_b(ceil(len_b / BS) * BS) * num_kv_heads * head_dim * itemsize / bandwidth

per layer (plus the block tables and q, which are tiny). On an H200 (4.8 TB/s peak HBM;
~4.3 TB/s measured for a device-to-device copy, which reads and writes) a batch of 64
sequences of 4k tokens with 8 kv heads of 128 dims in bf16 reads 1.07 GB per layer: at
least ~0.25 ms per layer. `bench.kernel_bench` reports the achieved fraction of that.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import common, kv_quant

TARGET_PROGRAMS = 264  # 2 waves of the H200's 132 SMs
MAX_SPLITS = 16
MIN_STEPS_PER_SPLIT = 2
TOKENS_PER_STEP = 128
MIN_ROWS = 16  # Triton's tl.dot needs at least 16 rows


def default_pages_per_step(block_size: int, table_width: int) -> int:
    """Pages gathered per loop step: ~128 tokens, >= 16 tokens, no more than the table."""
    pages = max(1, TOKENS_PER_STEP // block_size)
    pages = min(pages, common.next_power_of_2(table_width))
    return max(pages, common.next_power_of_2(common.cdiv(16, block_size)))


def default_num_splits(batch: int, num_kv_heads: int, table_steps: int) -> int:
    """Flash-decoding split count for a batch bucket: fill ~2 waves of SMs, keep splits long."""
    programs = batch * num_kv_heads
    if programs >= TARGET_PROGRAMS:
        return 1
    wanted = common.cdiv(TARGET_PROGRAMS, programs)
    return max(1, min(wanted, MAX_SPLITS, table_steps // MIN_STEPS_PER_SPLIT))


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    scale: float
    soft_cap: float | None
    sliding_window: int | None
    pages_per_step: int
    num_splits: int
    num_warps: int
    num_stages: int
    interpret: bool
    sinks: bool = False  # attention sinks are given: they join the partials' merge

    @property
    def partials(self) -> bool:
        """Whether programs write unnormalized partials (acc, m, l) for `common.merge_splits`."""
        return self.num_splits > 1 or self.sinks


def _decode_kernel(
    layer_ref,
    lengths_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    cfg: DecodeConfig,
    block_size: int,
    pages_per_split: int,
):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    length = lengths_ref[b]
    q = q_ref[b, h]  # [Gp, D]
    rows, head_dim = q.shape
    pages_per_step = cfg.pages_per_step
    tokens_per_step = pages_per_step * block_size

    num_pages = common.cdiv(length, block_size)
    first = split * pages_per_split
    last = jnp.minimum(first + pages_per_split, num_pages)
    step_hi = jnp.maximum(common.cdiv(last - first, pages_per_step), 0)
    step_lo = 0
    if cfg.sliding_window is not None:
        window_first_page = jnp.maximum(length - cfg.sliding_window, 0) // block_size
        step_lo = jnp.maximum(window_first_page - first, 0) // pages_per_step

    def body(i, state):
        page0 = first + i * pages_per_step
        pages = tables_ref[b, pl.ds(page0, pages_per_step)]
        pages = jnp.where(page0 + jnp.arange(pages_per_step) < num_pages, pages, 0)
        k = common.load_pages(k_ref, layer, h, pages, head_dim)
        v = common.load_pages(v_ref, layer, h, pages, head_dim)
        token = page0 * block_size + jnp.arange(tokens_per_step)
        valid = token < length
        if cfg.sliding_window is not None:
            valid &= token >= length - cfg.sliding_window
        valid = jnp.broadcast_to(valid[None, :], (rows, tokens_per_step))
        return common.attend_step(state, q, k, v, valid, scale=cfg.scale, soft_cap=cfg.soft_cap)

    state = jax.lax.fori_loop(step_lo, step_hi, body, common.SoftmaxState.empty(rows, head_dim))
    if not cfg.partials:
        (o_ref,) = out_refs
        o_ref[b, h] = state.normalized().astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[split, b, h] = state.acc
        m_ref[split, b, h] = state.m
        l_ref[split, b, h] = state.l


@functools.partial(jax.jit, static_argnames=("cfg",))
def _decode(q, k_cache, v_cache, layer, block_tables, lengths, sinks, cfg: DecodeConfig):
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    rows = max(common.next_power_of_2(group), MIN_ROWS)

    steps = common.cdiv(block_tables.shape[1], cfg.pages_per_step)
    pages_per_split = common.cdiv(steps, cfg.num_splits) * cfg.pages_per_step
    tables = common.pad_block_table(block_tables, cfg.num_splits * pages_per_split)
    qg = common.group_queries(q, num_kv_heads, rows, kv_quant.value_dtype(k_cache.dtype))
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))

    grid_shape = (batch, num_kv_heads, rows)
    if not cfg.partials:
        out_shape = jax.ShapeDtypeStruct((*grid_shape, head_dim), q.dtype)
    else:
        parts = (cfg.num_splits, *grid_shape)
        out_shape = (
            jax.ShapeDtypeStruct((*parts, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(parts, jnp.float32),
            jax.ShapeDtypeStruct(parts, jnp.float32),
        )
    kernel = common.fresh_kernel(_decode_kernel, cfg=cfg, block_size=block_size, pages_per_split=pages_per_split)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(batch, num_kv_heads, cfg.num_splits),
        interpret=cfg.interpret,
        compiler_params=common.compiler_params(cfg.interpret, cfg.num_warps, cfg.num_stages),
        name=f"paged_decode_g{group}_bs{block_size}_p{cfg.pages_per_step}_s{cfg.num_splits}",
    )(layer, lengths.astype(jnp.int32), tables, qg, k_cache, v_cache)
    if cfg.partials:
        out = common.merge_splits(*out, None if sinks is None else common.grouped_sinks(sinks, num_kv_heads, rows))
    return out[:, :, :group].reshape(batch, num_heads, head_dim).astype(q.dtype)


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
    interpret: bool | None = None,
    pages_per_step: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 8,
    num_stages: int = 2,
) -> jax.Array:
    """q [B, H, D] -> [B, H, D]; see `reference.decode_attention` for the contract.

    interpret: None = on when JAX's default backend is CPU (or as $JAXSERVE_PALLAS_INTERPRET
    says). pages_per_step (a power of two) and num_splits default to per-shape heuristics.
    num_warps / num_stages are Triton launch settings (8 warps: a 128-token x 128-dim K/V
    tile per step is 16k gathered pointers; JAX's shipped kernel uses the same), untuned.
    Block-table entries past a sequence's pages are never read; `lengths[b]` must not
    exceed the table's width x block_size.
    """
    interpret = common.resolve_interpret(interpret)
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    width = block_tables.shape[1]
    if pages_per_step is None:
        pages_per_step = default_pages_per_step(block_size, width)
    if pages_per_step & (pages_per_step - 1):
        raise ValueError(f"pages_per_step must be a power of two, got {pages_per_step}")
    common.check_native_shapes(head_dim, block_size, pages_per_step * block_size, interpret)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, common.cdiv(width, pages_per_step))
    cfg = DecodeConfig(
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        pages_per_step=int(pages_per_step),
        num_splits=max(1, int(num_splits)),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        sinks=sinks is not None,
    )
    return _decode(q, k_cache, v_cache, layer, block_tables, lengths, sinks, cfg)
