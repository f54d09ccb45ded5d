"""The decoder's layers as pipeline stages: a step's rows cut into micro-batches for
`sharding.pipeline_schedule.run_pipeline`.

A decode step's rows are its sequences (row b is sequence b's one new token), so its rows split
into up to `microbatches` equal groups, each with its sequences' block tables and lengths; the
rows that round a group up are padding (KV slot 0 in block 0, length 0), as a bucket's are. A
prefill step's rows are cut into contiguous groups of tokens: each group attends with its own
ragged metadata (each sequence's rows inside the group, its length up to the group's last row),
which is causal because a stage runs the groups in order, so a group's earlier rows have written
their K/V in that stage's layers before it reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.model.decoder_layer import Carry
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.rope import RopeTables
from sharding.pipeline_schedule import run_pipeline

# stage_layers(stage params, (h, cache), rope, meta) -> (h, cache): a stage's layers (`LayerStack.stage`).
StageLayers = Callable[[Any, Carry, RopeTables, AttentionMetadata], Carry]


@dataclasses.dataclass(frozen=True)
class PipelineLayers:
    """Runs a model's stacked layers as the stages of `mesh`'s `pp` axis, an iteration's rows in up
    to `microbatches` micro-batches. Called as `DecoderModel.pipeline`."""

    mesh: Mesh
    microbatches: int

    def __call__(
        self, stage_layers: StageLayers, params: Any, carry: Carry, rope: RopeTables, meta: AttentionMetadata
    ) -> tuple[Carry, jax.Array]:
        """The layers' (h, cache) after the step, and the [P, ticks] schedule each stage ran."""
        h, cache = carry
        rows = h.shape[0]
        num = max(1, min(self.microbatches, rows))
        size = -(-rows // num)
        groups = _split_tree(meta, num, size) if meta.query_start is None else _prefill_groups(meta, num, size)
        inputs, extras = _split_rows(h, num, size), (_split_tree(rope, num, size), groups)

        def stage(params, cache, x, extra):
            rope, meta = extra
            return stage_layers(params, (x, cache), rope, meta)

        out, cache, ran = run_pipeline(stage, self.mesh, params, cache, inputs, extras)
        return (out.reshape(num * size, *out.shape[2:])[:rows], cache), ran


def _split_rows(x: jax.Array, num: int, size: int) -> jax.Array:
    """x [rows, ...] -> [num, size, ...], zero rows appended."""
    pad = num * size - x.shape[0]
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(num, size, *x.shape[1:])


def _split_tree(tree: Any, num: int, size: int) -> Any:
    return jax.tree.map(lambda x: _split_rows(x, num, size), tree)


def _prefill_groups(meta: AttentionMetadata, num: int, size: int) -> AttentionMetadata:
    """Per group g of rows [g * size, (g + 1) * size) of a prefill step: its KV slots, and each
    sequence's rows in the group (query_start, re-based) and length after the group's last row.
    A decode row of a mixed step belongs to the group holding it; elsewhere it is padding (row
    out of range, length 0)."""
    chunks = meta.query_start.shape[0] - 1
    start = jnp.arange(num, dtype=jnp.int32)[:, None] * size  # [num, 1]
    qs = jnp.clip(meta.query_start[None, :], start, start + size)  # [num, chunks + 1]
    cut = meta.query_start[None, 1:] - qs[:, 1:]  # rows of each chunk after the group
    chunk_lens = jnp.where(qs[:, 1:] > qs[:, :-1], meta.seq_lens[None, :chunks] - cut, 0)
    seq_lens = jnp.broadcast_to(meta.seq_lens, (num, meta.seq_lens.shape[0]))
    seq_lens = seq_lens.at[:, :chunks].set(chunk_lens)
    decode_rows = None
    if meta.decode_rows is not None:
        local = meta.decode_rows[None, :] - start
        inside = (local >= 0) & (local < size)
        decode_rows = jnp.where(inside, local, size)
        seq_lens = seq_lens.at[:, chunks:].set(jnp.where(inside, seq_lens[:, chunks:], 0))
    tables = jnp.broadcast_to(meta.block_tables, (num, *meta.block_tables.shape))
    return AttentionMetadata(_split_rows(meta.kv_slots, num, size), tables, seq_lens, qs - start, decode_rows)
