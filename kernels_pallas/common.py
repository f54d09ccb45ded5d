"""Pieces shared by the Pallas paged-attention kernels (and, for the tile layout, paged_jax).

The kernels are written for the Triton backend of Pallas (jax 0.10 and 0.11) and for
interpret mode on CPU, so they keep to what both accept:

- Every kernel input is passed whole (no BlockSpecs): neither GPU backend has scalar
  prefetch, so an index map could not depend on the block table or the layer index anyway.
  The kernel indexes the refs itself with program ids and values it reads from int32 refs.
- Every array a kernel loads, stores or computes has a power-of-two number of elements, and
  the matmuls have at least 16 rows (Triton `tl.dot`); the wrappers pad the query heads of a
  kv head up to that.
- K/V pages are gathered with a vector of block ids (`ref[layer, head, pages]`), which
  lowers to one pointer tensor in Triton (64-bit offsets once the cache passes 4 GiB).
- Matmuls ask for `Precision.HIGHEST`: on Triton the default for f32 would be TF32.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import kv_quant

INTERPRET_ENV = "JAXSERVE_PALLAS_INTERPRET"
MASKED = -1e30  # finite: a fully masked step must not produce inf - inf = NaN


def resolve_interpret(interpret: bool | None) -> bool:
    """An explicit flag wins; then $JAXSERVE_PALLAS_INTERPRET (0/1); then: interpret on CPU."""
    if interpret is not None:
        return bool(interpret)
    env = os.environ.get(INTERPRET_ENV)
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no")
    return jax.default_backend() == "cpu"


def compiler_params(interpret: bool, num_warps: int, num_stages: int) -> Any:
    """Triton launch parameters; None in interpret mode (the interpreter takes none)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # GPU-only concern; imported late

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: Any, b: Any) -> Any:
    """Ceiling division of non-negative ints (Python ints or int32 scalars inside a kernel)."""
    return (a + b - 1) // b


def check_native_shapes(head_dim: int, block_size: int, tokens_per_step: int, interpret: bool) -> None:
    """Triton needs power-of-two extents and matmul sides >= 16; the cache's we cannot pad."""
    if interpret:
        return
    for what, n in (("head_dim", head_dim), ("block_size", block_size)):
        if n & (n - 1):
            raise ValueError(
                f"the Pallas GPU kernels need a power-of-two {what}, got {n}; "
                "use the 'reference' attention backend for this cache"
            )
    if head_dim < 16 or tokens_per_step < 16:
        raise ValueError(
            f"the Pallas GPU kernels need head_dim >= 16 and >= 16 tokens per step, got "
            f"head_dim={head_dim}, tokens per step={tokens_per_step}"
        )


def pad_block_table(block_tables: jax.Array, width: int) -> jax.Array:
    """Pad the last axis with block 0 (reserved, harmless) so the kernel never reads past it."""
    extra = width - block_tables.shape[-1]
    if extra == 0:
        return block_tables.astype(jnp.int32)
    return jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, extra)))


def group_queries(q: jax.Array, num_kv_heads: int, padded_group: int, dtype: Any) -> jax.Array:
    """[N, H, D] -> [N, KVH, Gp, D] in the cache's dtype (Triton's dot wants one operand type):
    the query heads of each kv head, zero-padded to Gp."""
    n, h, d = q.shape
    g = h // num_kv_heads
    qg = q.astype(dtype).reshape(n, num_kv_heads, g, d)
    if padded_group > g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded_group - g), (0, 0)))
    return qg


def tile_layout(query_start: jax.Array, seq_lens: jax.Array, num_tiles: int, block_q: int) -> jax.Array:
    """[num_tiles, 4] int32: (sequence, first row, rows, position of the first row) per tile.

    Unused tiles get (0, 0, 0, 0): no rows, so the kernel reads nothing and writes zeros.
    """
    query_start = query_start.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    q_len = query_start[1:] - query_start[:-1]
    tiles = cdiv(q_len, block_q)
    tile_end = jnp.cumsum(tiles)
    tile_begin = tile_end - tiles
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), q_len.shape[0] - 1)
    local = (t - tile_begin[seq]) * block_q
    used = t < tile_end[-1]
    rows = jnp.where(used, jnp.clip(q_len[seq] - local, 0, block_q), 0)
    first_row = jnp.where(used, query_start[seq] + local, 0)
    first_pos = jnp.where(used, seq_lens[seq] - q_len[seq] + local, 0)
    return jnp.stack([jnp.where(used, seq, 0), first_row, rows, first_pos], axis=1).astype(jnp.int32)


def row_to_tile(query_start: jax.Array, num_tokens: int, block_q: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each flattened row: its tile, its offset in the tile, and whether it is real."""
    query_start = query_start.astype(jnp.int32)
    q_len = query_start[1:] - query_start[:-1]
    tiles = cdiv(q_len, block_q)
    tile_begin = jnp.cumsum(tiles) - tiles
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start, t, side="right") - 1, 0, q_len.shape[0] - 1)
    local = t - query_start[seq]
    return tile_begin[seq] + local // block_q, local % block_q, t < query_start[-1]


class SoftmaxState(NamedTuple):
    """Running max, running denominator and unnormalized output of an online softmax."""

    m: jax.Array  # [M] f32
    l: jax.Array  # [M] f32
    acc: jax.Array  # [M, D] f32

    @classmethod
    def empty(cls, rows: int, head_dim: int) -> SoftmaxState:
        return cls(
            jnp.full((rows,), MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        )

    @classmethod
    def start(cls, rows: int, head_dim: int, sinks: jax.Array | None) -> SoftmaxState:
        """The state before the first key: empty, or with each row's attention sink folded in
        (sinks [..., rows]: a logit in the denominator that has no value, so a key of value zero;
        a row that then sees no key comes out as zeros)."""
        if sinks is None:
            return cls.empty(rows, head_dim)
        m = sinks.astype(jnp.float32)  # [..., rows]
        return cls(m, jnp.ones_like(m), jnp.zeros((*m.shape, head_dim), jnp.float32))

    def normalized(self) -> jax.Array:
        """acc / l, with rows that saw no key (l == 0) coming out as zeros."""
        return self.acc / jnp.where(self.l == 0.0, 1.0, self.l)[..., None]


def merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Log-sum-exp merge of flash-decoding partials over the leading split axis: acc [S, ..., D]
    unnormalized outputs, m [S, ...] running maxima, l [S, ...] denominators; `sinks` [...]
    (optional, broadcast against m[0]): each row's attention sink, one more partial of m = sink,
    l = 1 and no value.
    Sequences that saw no key (every l == 0) give zeros."""
    if sinks is not None:
        m = jnp.concatenate([m, jnp.broadcast_to(sinks.astype(jnp.float32), m.shape[1:])[None]])
        l = jnp.concatenate([l, jnp.ones_like(l[:1])])
        acc = jnp.concatenate([acc, jnp.zeros_like(acc[:1])])
    m_max = jnp.max(m, axis=0)
    weight = jnp.exp(m - m_max[None])
    denom = jnp.sum(l * weight, axis=0)
    out = jnp.sum(acc * weight[..., None], axis=0)
    return out / jnp.where(denom == 0.0, 1.0, denom)[..., None]


def grouped_sinks(sinks: jax.Array, num_kv_heads: int, padded_group: int) -> jax.Array:
    """Sinks [H] -> [KVH, Gp] f32, as `group_queries` lays out the heads (padding heads MASKED)."""
    g = sinks.shape[0] // num_kv_heads
    grouped = sinks.astype(jnp.float32).reshape(num_kv_heads, g)
    return jnp.pad(grouped, ((0, 0), (0, padded_group - g)), constant_values=MASKED)


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    return lax.dot_general(
        a,
        b,
        (((1,), (contract_b,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def attend_step(
    state: SoftmaxState,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid: jax.Array,
    *,
    scale: float,
    soft_cap: float | None,
) -> SoftmaxState:
    """Fold one tile of keys into the online softmax: q [M, D], k/v [N, D], valid [M, N]."""
    s = _dot(q, k, 1) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(valid, s, MASKED)
    m_new = jnp.maximum(state.m, jnp.max(s, axis=1))
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(state.m - m_new)
    l_new = alpha * state.l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * state.acc + _dot(p.astype(v.dtype), v, 0)
    return SoftmaxState(m_new, l_new, acc)


def load_pages(cache_ref: Any, layer: jax.Array, head: jax.Array, pages: jax.Array, head_dim: int) -> jax.Array:
    """Gather pages [P] of one layer and kv head from the stacked cache -> [P * BS, D], in
    `kv_quant.value_dtype` of the cache. A scaled row's values and its 4 scale bytes are loaded
    apart (Triton takes power-of-two blocks only: D, not D + 4)."""
    if not kv_quant.is_scaled(cache_ref.dtype):
        block = kv_quant.dequantize(cache_ref[layer, head, pages])  # [P, BS, D]
        p, bs, d = block.shape
        return block.reshape(p * bs, d)
    values = cache_ref[layer, head, pages, :, pl.ds(0, head_dim)]  # [P, BS, D]
    scale = kv_quant.scale_from_bytes(
        *(cache_ref[layer, head, pages, :, head_dim + i] for i in range(kv_quant.SCALE_ELEMENTS))
    )  # [P, BS]
    block = kv_quant.values_to_f32(values) * scale[..., None]
    p, bs, d = block.shape
    return block.reshape(p * bs, d)


def fresh_kernel(kernel: Any, **static: Any) -> Any:
    """A new partial per configuration (jax 0.11 can reuse a stale jaxpr for a reused callable)."""
    return functools.partial(kernel, **static)
