"""The rows of a ragged prefill program that do more than feed the model: the rows that score prompt
positions (prompt log-probabilities) and the rows that embeddings pool. Chunk i's rows follow chunk i - 1's,
`num_new_tokens` each, as `StepInputs.prefill` lays them out."""

from __future__ import annotations

import numpy as np

from jaxserve.runner.prepared_step import PooledRows, PromptScores
from jaxserve.scheduler.output import ScheduledChunk


def score_rows(
    chunks: list[ScheduledChunk], num_tokens: int, scores: list[PromptScores] | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """Rows and target tokens of the prompt positions these chunks score: the row of position p - 1 gives
    the log-probability of prompt token p. Positions already scored (before a recompute) are skipped.
    Each scoring chunk's rows are listed in `scores`."""
    rows, targets, row = [], [], 0
    for c in chunks:
        req, n = c.request, c.num_new_tokens
        if req.prompt_logprobs is not None:
            first = max(len(req.prompt_logprobs), c.start + 1)
            last = min(c.start + n, req.num_prompt_tokens - 1)
            if first <= last:
                if scores is not None:
                    scores.append(PromptScores(req, len(rows), first, last - first + 1))
                rows.extend(range(row + first - 1 - c.start, row + last - c.start))
                targets.extend(req.prompt_token_ids[first : last + 1])
        row += n
    if not rows:
        return None
    padded_rows, padded_targets = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    padded_rows[: len(rows)], padded_targets[: len(targets)] = rows, targets
    return padded_rows, padded_targets


def pool_rows(
    chunks: list[ScheduledChunk], num_tokens: int, pooled: list[PooledRows] | None, num_segments: int
) -> np.ndarray | None:
    """Each row's pooling segment: one per chunk of an embedding request that pools rows
    (`PromptPooling.positions`, listed in `pooled`), `num_segments` for the other rows; None when no
    row pools."""
    segments, row, segment = np.full(num_tokens, num_segments, np.int32), 0, 0
    for c in chunks:
        req = c.request
        if req.pooling is not None:
            positions = req.pooling.positions(c.start, c.num_new_tokens, req.num_prompt_tokens)
            if positions:
                segments[row + positions.start - c.start : row + positions.stop - c.start] = segment
                if pooled is not None:
                    pooled.append(PooledRows(req, segment, positions))
                segment += 1
        row += c.num_new_tokens
    return segments if segment else None
