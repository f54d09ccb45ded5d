"""The host arrays of a verify program (speculative decoding): the target model checks each decode's
draft tokens in one ragged step, and the verify sampler (`jaxserve.speculative.verify`) keeps the accepted
ones. Every other program kind is built in inputs.py (`StepInputs`), whose persistent batch this one
gathers its block tables and sampling rows from."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxserve.model import AttentionMetadata
from jaxserve.request import PLACEHOLDER
from jaxserve.runner.prepared_step import Program
from jaxserve.scheduler.output import ScheduledChunk

if TYPE_CHECKING:
    from jaxserve.runner.inputs import StepInputs


def verify_program(
    inputs: StepInputs, chunks: list[ScheduledChunk], batch: int, width: int, batch_rows: np.ndarray | None = None
) -> Program:
    """A verify program (speculative decoding): a ragged step of `verify_rows` = k + 1 rows per
    sequence (its last token, then its drafts; rows past a shorter draft are padding that
    writes into block 0) with logits at every row, and one sampling row per logits row.
    Every token of its chunks is known on the host: speculative steps are synchronous (see
    `LLMEngine.step`). `batch_rows`: the chunks' batch rows (`StepInputs.decode_batch_rows`; looked up
    here when None)."""
    bs, rows = inputs.config.block_size, inputs.verify_rows
    batch_rows = inputs.decode_batch_rows(chunks) if batch_rows is None else batch_rows
    num_tokens = batch * rows
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    kv_slots = np.zeros(num_tokens, np.int32)
    seq_lens = np.zeros(batch, np.int32)
    query_start = np.zeros(batch + 1, np.int32)
    tables = inputs.batch.tables[inputs.padded(batch_rows, batch), :width]
    drafts = np.full(num_tokens, -1, np.int32)
    history = np.full((num_tokens, rows - 1), -1, np.int32)
    sampled = []  # (row, batch_row, drafts before it) of each row that samples
    for i, c in enumerate(chunks):
        req, row, n = c.request, i * rows, 1 + len(c.draft)
        if PLACEHOLDER in req.output_token_ids[-1:]:
            raise ValueError(f"request {req.request_id!r} is verified with its last token in flight")
        pos = c.start + np.arange(rows)
        tokens[row : row + n] = [req.last_token_id, *c.draft]
        positions[row : row + rows] = pos
        kv_slots[row : row + n] = tables[i, pos[:n] // bs] * bs + pos[:n] % bs
        seq_lens[i] = c.start + rows
        query_start[i + 1] = row + rows
        drafts[row : row + n - 1] = c.draft
        for j in range(n):
            history[row + j, :j] = c.draft[:j]
            if c.sample:
                sampled.append((row + j, batch_rows[i], j))
    query_start[len(chunks) + 1 :] = len(chunks) * rows
    meta = AttentionMetadata(
        kv_slots,
        tables,
        seq_lens,
        query_start,
        lora_slots=inputs.lora_rows(chunks, num_tokens, [rows] * len(chunks)),
    )
    host_args = (tokens, positions, meta, np.arange(num_tokens, dtype=np.int32), np.full(num_tokens, -1, np.int32))
    masks = inputs.constrained_rows(chunks, batch_rows, rows)
    inputs.check_sampling(chunks)
    sampled_rows, sampled_batch_rows, ahead = np.array(sampled, np.intp).reshape(-1, 3).T
    sampling = inputs.batch.sampling(sampled_rows, sampled_batch_rows, ahead, num_tokens, bool(masks))
    return Program(
        ("verify", batch, width),
        host_args,
        sampling,
        0,
        batch_rows,
        drafts=(drafts, history, *([_draft_probs(inputs, chunks, num_tokens)] if inputs.verify_vocab else [])),
        masks=masks,
        constrained=bool(masks),
    )


def _draft_probs(inputs: StepInputs, chunks: list[ScheduledChunk], num_tokens: int) -> np.ndarray:
    """f32[num_tokens, V]: q of the draft token each row tests (a draft model's, for rejection sampling);
    zeros where the draft is deterministic (greedy) or there is none."""
    probs = np.zeros((num_tokens, inputs.verify_vocab), np.float32)
    for i, c in enumerate(chunks):
        if c.draft_probs is not None:
            row = i * inputs.verify_rows
            probs[row : row + len(c.draft)] = c.draft_probs
    return probs
