"""Decode paged attention for Hopper in Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`).

Same contract as `reference.decode_attention`; `decode.py` is the Triton kernel beside it and
`gpu_select.py` says which of the two the `pallas` backend runs.

Work split. The grid is (batch, kv_head, split), one CTA each, two warpgroups per CTA:

- the memory warpgroup reads the sequence's block-table entries (scalar loads) and streams its
  K and V pages into a ring of `num_stages` SMEM slots with TMA, one copy per page and
  `pages_per_step` pages per slot, each slot's arrival tracked by a barrier; it refills a slot
  as soon as the compute warpgroup releases it, so table reads and copy issue never stall the
  math;
- the compute warpgroup holds the query heads of its kv head (GQA packing: each byte of K/V is
  read once for the whole group) zero-padded to the 64 rows of a warpgroup matmul, and per slot
  runs S = Q K^T and P V as WGMMAs (bf16/f16 in, f32 out) with an online softmax in f32
  registers between them.

Why WGMMA pays at every group size: padding g query heads to 64 rows costs 64/g times the
matmul work, yet per 64-token step of 128-dim bf16 K/V (32 KiB read) the two matmuls are 2 MFLOP
at 64 rows, ~64 FLOP per byte, where an H100/H200 does ~200-300 bf16 FLOP per byte of HBM
bandwidth: the kernel stays memory-bound, and the CUDA cores are left to the softmax.

P goes to SMEM before its WGMMA (FlashAttention-3 keeps it in registers): 8 KiB of SMEM
writes per step next to 32 KiB of K/V, and the form JAX's Mosaic GPU interpreter runs, so this
kernel is checked against the reference on a CPU (jax >= 0.11). The P V product starts from a
zero accumulator and is added to the rescaled output in registers, for the same reason.

When batch x kv_heads is too small to fill the GPU, the block table is cut into `num_splits`
contiguous ranges (flash-decoding): each CTA writes its unnormalized f32 output with its running
max and denominator, and `common.merge_splits` combines them (log-sum-exp). Attention sinks
(gpt-oss) join in that merge: with sinks the kernel always runs at least two splits.

Limits, each a clear error (`unsupported_reason`): a bf16 or f16 cache (WGMMA has no IEEE f32),
at most 64 query heads per kv head, head_dim a multiple of 16 up to 256, block_size a multiple
of 8 (the SMEM tile's rows). It runs on Hopper only (sm_90: TMA and WGMMA; Blackwell has no
WGMMA). `gpu_select` runs the Triton kernel wherever one of these does not hold.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import common
from kernels_pallas.decode import default_num_splits  # one split heuristic for both kernels

MMA_ROWS = 64  # rows of one warpgroup's WGMMA tile
ROW_TILE = 8  # rows of an SMEM tile: query rows and pages come in multiples of it
MAX_HEAD_DIM = 256  # WGMMA's widest N
TOKENS_PER_STEP = 64  # keys per pipeline slot
NUM_STAGES = 4  # pipeline slots
SMEM_BUDGET = 220 * 1024  # of Hopper's 227 KiB per CTA, leaving room for Mosaic's own scratch
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
COMPUTE, MEMORY = 0, 1  # warpgroup ids


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    scale: float
    soft_cap: float | None
    sliding_window: int | None
    pages_per_step: int
    num_splits: int
    num_stages: int
    interpret: bool


def interpret_available() -> bool:
    """Whether this jax has a public Mosaic GPU interpreter (`plgpu.InterpretGPUParams`, jax 0.11+)."""
    return hasattr(plgpu, "InterpretGPUParams")


def unsupported_reason(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> str | None:
    """Why this kernel cannot take a cache of this shape and dtype; None when it can."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"the Mosaic GPU decode kernel takes a bf16 or f16 cache, got {jnp.dtype(dtype).name}"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not group over {num_kv_heads} kv heads"
    if num_heads // num_kv_heads > MMA_ROWS:
        return f"the Mosaic GPU decode kernel takes at most {MMA_ROWS} query heads per kv head"
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return f"the Mosaic GPU decode kernel needs head_dim a multiple of 16 up to {MAX_HEAD_DIM}, got {head_dim}"
    if block_size % ROW_TILE:
        return f"the Mosaic GPU decode kernel needs block_size a multiple of {ROW_TILE}, got {block_size}"
    return None


def default_pages_per_step(block_size: int, table_width: int) -> int:
    """~TOKENS_PER_STEP keys per slot, no more than the table needs, and at least 16 keys (the
    K side of the P V matmul); a power of two."""
    pages = max(1, TOKENS_PER_STEP // block_size)
    pages = min(pages, common.next_power_of_2(table_width))
    return max(pages, common.next_power_of_2(common.cdiv(16, block_size)))


def _smem_transforms(head_dim: int, tokens: int, dtype) -> tuple:
    """The SMEM layout WGMMA reads: (8, swizzle) tiles and a swizzle, the same for every operand
    (WGMMA wants one swizzle on both sides), the widest that rows of head_dim and of `tokens`
    elements both take."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = min(plgpu.find_swizzle(head_dim * bits), plgpu.find_swizzle(tokens * bits))
    return plgpu.TilingTransform((ROW_TILE, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def smem_bytes(head_dim: int, tokens: int, num_stages: int, itemsize: int, num_splits: int) -> int:
    """SMEM one CTA allocates: Q, the K and V rings, P, the output tile, and m / l."""
    out_itemsize = 4 if num_splits > 1 else itemsize
    return (
        MMA_ROWS * head_dim * itemsize
        + 2 * num_stages * tokens * head_dim * itemsize
        + MMA_ROWS * tokens * itemsize
        + MMA_ROWS * head_dim * out_itemsize
        + 2 * MMA_ROWS * 4
    )


def fit_to_smem(
    pages_per_step: int | None,
    block_size: int,
    table_width: int,
    head_dim: int,
    itemsize: int,
    num_splits: int,
    num_stages: int | None,
) -> tuple[int, int]:
    """(pages_per_step, num_stages), each as given or else chosen to fit the SMEM budget:
    NUM_STAGES slots of `default_pages_per_step` pages, then fewer slots down to 2, then half
    the pages per slot while a slot keeps 16 keys (head_dim 256 needs that)."""
    pages = default_pages_per_step(block_size, table_width) if pages_per_step is None else pages_per_step
    stages = NUM_STAGES if num_stages is None else num_stages

    def fits() -> bool:
        return smem_bytes(head_dim, pages * block_size, stages, itemsize, num_splits) <= SMEM_BUDGET

    while not fits() and num_stages is None and stages > 2:
        stages -= 1
    while not fits() and pages_per_step is None and pages > 1 and (pages // 2) * block_size >= 16:
        pages //= 2
    return pages, stages


def _kernel(
    layer_ref,
    lengths_ref,
    tables_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    cfg: MosaicDecodeConfig,
    block_size: int,
    num_blocks: int,
    num_kv_heads: int,
    pages_per_split: int,
):
    """One CTA: sequence `b`, kv head `h`, split `s`, on two warpgroups (see the module docstring)."""
    num_outputs = 1 if cfg.num_splits == 1 else 3
    outs, scratch = refs[:num_outputs], refs[num_outputs:]
    q_smem, k_smem, v_smem, p_smem, o_smem, ml_smem, q_bar, k_full, v_full, k_free, v_free = scratch
    b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    wg = lax.axis_index("wg")
    stages, pages = cfg.num_stages, cfg.pages_per_step
    tokens = pages * block_size
    rows, head_dim = q_smem.shape
    q_rows = q_ref.shape[2]

    length = lengths_ref[b]
    num_pages = common.cdiv(length, block_size)
    first = s * pages_per_split  # this split's first page
    last = jnp.minimum(first + pages_per_split, num_pages)
    hi = jnp.maximum(common.cdiv(last - first, pages), 0)  # steps of this split
    lo = jnp.int32(0)
    if cfg.sliding_window is not None:  # steps wholly before the window are skipped
        window_first_page = jnp.maximum(length - cfg.sliding_window, 0) // block_size
        lo = jnp.minimum(jnp.maximum(window_first_page - first, 0) // pages, hi)

    def slot_of(step):
        return lax.rem(step - lo, stages)

    @pl.when(wg == MEMORY)
    def _memory():
        base = (layer_ref[0] * num_kv_heads + h) * num_blocks  # page 0 of this layer and kv head

        def fill(step, slot, cache_ref, smem, barrier):
            for p in range(pages):
                index = first + step * pages + p  # < the padded table width, by construction
                page = jnp.where(index < num_pages, tables_ref[b, index], 0)  # past the end: block 0
                plgpu.copy_gmem_to_smem(
                    cache_ref.at[base + page], smem.at[slot, pl.ds(p * block_size, block_size)], barrier.at[slot]
                )

        for j in range(stages):

            @pl.when(lo + j < hi)
            def _prologue():
                fill(lo + j, j, k_ref, k_smem, k_full)
                fill(lo + j, j, v_ref, v_smem, v_full)

        @pl.loop(lo + stages, hi)
        def _refill(step):
            slot = slot_of(step)
            plgpu.barrier_wait(k_free.at[slot])
            fill(step, slot, k_ref, k_smem, k_full)
            plgpu.barrier_wait(v_free.at[slot])
            fill(step, slot, v_ref, v_smem, v_full)

        # The releases of the last slots: every completion of a barrier gets its wait.
        @pl.loop(jnp.maximum(hi - stages, lo), hi)
        def _drain(step):
            plgpu.barrier_wait(k_free.at[slot_of(step)])
            plgpu.barrier_wait(v_free.at[slot_of(step)])

    @pl.when(wg == COMPUTE)
    def _compute():
        # Query rows past the group's stay zero: their scores and outputs are dropped.
        q_smem[...] = plgpu.layout_cast(jnp.zeros((rows, head_dim), q_smem.dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem.at[pl.ds(0, q_rows)], q_bar)
        plgpu.barrier_wait(q_bar)
        cols = plgpu.broadcasted_iota(jnp.int32, (rows, tokens), 1, layout=plgpu.Layout.WGMMA)

        def widen(x, shape):
            return lax.broadcast_in_dim(x, shape, [0])

        def matmul(a_smem, b_smem, n):
            def run(acc_ref):
                plgpu.wgmma(acc_ref, a_smem, b_smem)
                return acc_ref[...]

            return pl.run_scoped(run, plgpu.ACC((rows, n), jnp.float32))

        def step_body(step, carry):
            acc, m, l = carry
            slot = slot_of(step)
            plgpu.barrier_wait(k_full.at[slot])
            sc = matmul(q_smem, k_smem.at[slot].T, tokens) * cfg.scale
            plgpu.barrier_arrive(k_free.at[slot])
            if cfg.soft_cap is not None:
                sc = cfg.soft_cap * jnp.tanh(sc / cfg.soft_cap)
            token = (first + step * pages) * block_size + cols
            valid = token < length
            if cfg.sliding_window is not None:
                valid = valid & (token >= length - cfg.sliding_window)
            sc = jnp.where(valid, sc, common.MASKED)
            m_new = jnp.maximum(m, sc.max(axis=1))
            p = jnp.where(valid, jnp.exp(sc - widen(m_new, sc.shape)), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(axis=1)
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()  # P is a WGMMA operand: visible to the tensor cores first
            plgpu.barrier_wait(v_full.at[slot])
            pv = matmul(p_smem, v_smem.at[slot], head_dim)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc * widen(alpha, acc.shape) + pv, m_new, l

        row_layout = plgpu.Layout.WGMMA.reduce(1)
        init = (
            plgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((rows,), common.MASKED, jnp.float32), row_layout),
            plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout),
        )
        acc, m, l = lax.fori_loop(lo, hi, step_body, init)
        if cfg.num_splits == 1:
            (o_ref,) = outs
            o_smem[...] = (acc / widen(jnp.where(l == 0.0, 1.0, l), acc.shape)).astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, q_rows)], o_ref.at[b, h])
        else:
            o_ref, m_ref, l_ref = outs
            o_smem[...] = acc
            ml_smem[0] = m
            ml_smem[1] = l
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, q_rows)], o_ref.at[s, b, h])
            plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[s, b, h])
            plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[s, b, h])
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _decode(q, k_cache, v_cache, layer, block_tables, lengths, sinks, cfg: MosaicDecodeConfig):
    batch, num_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q_rows = common.cdiv(group, ROW_TILE) * ROW_TILE
    dtype = k_cache.dtype
    tokens = cfg.pages_per_step * block_size

    steps = common.cdiv(block_tables.shape[1], cfg.pages_per_step)
    pages_per_split = common.cdiv(steps, cfg.num_splits) * cfg.pages_per_step
    tables = common.pad_block_table(block_tables, cfg.num_splits * pages_per_split)
    qg = common.group_queries(q, num_kv_heads, q_rows, dtype)  # [B, KVH, q_rows, D]
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    # One page per leading index, [L * KVH * NB, BS, D]: a bitcast of the contiguous cache.
    pages_shape = (num_layers * num_kv_heads * num_blocks, block_size, head_dim)
    k_pages, v_pages = k_cache.reshape(pages_shape), v_cache.reshape(pages_shape)

    transforms = _smem_transforms(head_dim, tokens, dtype)
    out_dtype = q.dtype if cfg.num_splits == 1 else jnp.float32
    stages = cfg.num_stages
    scratch = (
        plgpu.SMEM((MMA_ROWS, head_dim), dtype, transforms=transforms),  # Q
        plgpu.SMEM((stages, tokens, head_dim), dtype, transforms=transforms),  # K ring
        plgpu.SMEM((stages, tokens, head_dim), dtype, transforms=transforms),  # V ring
        plgpu.SMEM((MMA_ROWS, tokens), dtype, transforms=transforms),  # P
        plgpu.SMEM((MMA_ROWS, head_dim), out_dtype),  # output tile
        plgpu.SMEM((2, MMA_ROWS), jnp.float32),  # m, l
        plgpu.Barrier(),  # Q arrived
        plgpu.Barrier(num_arrivals=cfg.pages_per_step, num_barriers=stages),  # a K slot arrived
        plgpu.Barrier(num_arrivals=cfg.pages_per_step, num_barriers=stages),  # a V slot arrived
        plgpu.Barrier(num_barriers=stages),  # a K slot is free
        plgpu.Barrier(num_barriers=stages),  # a V slot is free
    )
    if cfg.num_splits == 1:
        out_type = jax.ShapeDtypeStruct((batch, num_kv_heads, q_rows, head_dim), q.dtype)
    else:
        parts = (cfg.num_splits, batch, num_kv_heads)
        out_type = (
            jax.ShapeDtypeStruct((*parts, q_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((*parts, MMA_ROWS), jnp.float32),
            jax.ShapeDtypeStruct((*parts, MMA_ROWS), jnp.float32),
        )
    kernel = common.fresh_kernel(
        _kernel,
        cfg=cfg,
        block_size=block_size,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        pages_per_split=pages_per_split,
    )
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=(batch, num_kv_heads, cfg.num_splits),
        grid_names=("b", "h", "s"),
        num_threads=2,
        thread_name="wg",
        # Lane semantics (explicit layouts): the default differs between jax 0.10 and 0.11.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if cfg.interpret else None,
        kernel_name=f"paged_decode_mgpu_g{group}_bs{block_size}_p{cfg.pages_per_step}_s{cfg.num_splits}",
    )
    out = call(layer, lengths.astype(jnp.int32), tables, qg, k_pages, v_pages)
    if cfg.num_splits > 1:
        acc, m, l = out
        grouped = None if sinks is None else common.grouped_sinks(sinks, num_kv_heads, q_rows)
        out = common.merge_splits(acc, m[..., :q_rows], l[..., :q_rows], grouped)
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
    num_stages: int | None = None,
) -> jax.Array:
    """q [B, H, D] -> [B, H, D]; see `reference.decode_attention` for the contract.

    interpret: None = on when JAX's default backend is CPU (or as $JAXSERVE_PALLAS_INTERPRET
    says); interpreting needs jax >= 0.11. pages_per_step (a power of two), num_splits and
    num_stages default to per-shape heuristics (`default_pages_per_step`,
    `decode.default_num_splits`, then `fit_to_smem`). Block-table entries past a
    sequence's pages are never read; `lengths[b]` must not exceed the table's width x block_size.
    """
    interpret = common.resolve_interpret(interpret)
    if interpret and not interpret_available():
        raise NotImplementedError(
            f"the Mosaic GPU decode kernel runs interpreted only on jax >= 0.11 (this is {jax.__version__}, "
            "without plgpu.InterpretGPUParams); use the Triton kernel (kernels_pallas.decode) here"
        )
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_cache.shape
    reason = unsupported_reason(num_heads, num_kv_heads, head_dim, block_size, k_cache.dtype)
    if reason:
        raise ValueError(reason)
    width = block_tables.shape[1]
    if num_stages is not None and not 2 <= num_stages <= 32:
        raise ValueError(f"num_stages must be 2 to 32, got {num_stages}")
    if num_splits is None:
        steps = common.cdiv(width, pages_per_step or default_pages_per_step(block_size, width))
        num_splits = default_num_splits(batch, num_kv_heads, steps)
    num_splits = max(1 if sinks is None else 2, int(num_splits))  # sinks join the merge of splits
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    pages_per_step, num_stages = fit_to_smem(
        pages_per_step, block_size, width, head_dim, itemsize, num_splits, num_stages
    )
    tokens = pages_per_step * block_size
    if pages_per_step < 1 or pages_per_step & (pages_per_step - 1) or tokens % 16 or tokens > 256:
        raise ValueError(
            f"pages_per_step must be a power of two giving 16 to 256 keys a step (a multiple of 16), "
            f"got {pages_per_step} pages of {block_size}"
        )
    need = smem_bytes(head_dim, tokens, num_stages, itemsize, num_splits)
    if need > SMEM_BUDGET:
        raise ValueError(
            f"{num_stages} stages of {tokens} keys x {head_dim} dims need {need} bytes of SMEM, "
            f"over the {SMEM_BUDGET} budgeted; use fewer stages or pages per step"
        )
    cfg = MosaicDecodeConfig(
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        pages_per_step=int(pages_per_step),
        num_splits=num_splits,
        num_stages=int(num_stages),
        interpret=interpret,
    )
    return _decode(q, k_cache, v_cache, layer, block_tables, lengths, sinks, cfg)
