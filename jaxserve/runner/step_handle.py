"""A launched iteration (`StepHandle`), what its programs give back (`StepResults`), and the
readers of its prompt scores and pooled rows (`read_prompt_scores`, `read_pooled`); the sampled
tokens are read by `ModelRunner.fetch`, which also updates the persistent batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

import jax
import numpy as np

from jaxserve.outputs import TokenLogprob
from jaxserve.request import Request
from jaxserve.runner.prepared_step import PooledRows, PreparedStep, PromptScores
from jaxserve.runner.step_counters import StepCounters
from jaxserve.sampler import SamplerOutput
from jaxserve.scheduler.output import ScheduledChunk

# What an iteration's programs give back: their sampler outputs, the prompt scores, the pooled sums,
# the model steps' counters.
StepResults = tuple[list[SamplerOutput], tuple[jax.Array, ...] | None, jax.Array | None, list[StepCounters]]


@dataclasses.dataclass
class StepHandle:
    """A launched iteration: for each of its programs, the chunks, their slots in the persistent
    batch and the sampler outputs the host will read (tokens; log-probabilities only when a
    chunk asked for them). While `awaits_masks`, it is dispatched up to its first grammar mask:
    `ModelRunner.complete_launch` writes the masks and dispatches the rest."""

    launch_index: int  # 1 for the runner's first launch
    parts: list[tuple[list[ScheduledChunk], np.ndarray, tuple[jax.Array, ...]]]
    launches_before_fetch: int = 0  # set by fetch: > launch_index when the next one went first
    # The prefill program's scored prompt positions and their (logprob, rank, top ids, top logprobs).
    prompt_scores: tuple[list[PromptScores], tuple[jax.Array, ...]] | None = None
    # The prefill program's pooled rows (embeddings) and the sum of each segment's rows.
    pooled: tuple[list[PooledRows], jax.Array] | None = None
    # Each model step's counters (not multi-step loops), when the runner counts anything.
    counters: list[StepCounters] = dataclasses.field(default_factory=list)
    # The rest of the launch (`ModelRunner._run_steps`), while it waits for the masks to be written.
    _rest: Generator[None, None, StepResults] | None = None
    _prepared: PreparedStep | None = None

    @property
    def awaits_masks(self) -> bool:
        return self._rest is not None


def read_prompt_scores(handle: StepHandle) -> list[tuple[Request, int, list[TokenLogprob]]]:
    """Wait for a launched iteration's prompt scores: for each request it scored, the first
    position and the scores of that position and the ones after it (with the request's
    `prompt_logprobs` most likely tokens)."""
    if handle.prompt_scores is None:
        return []
    scored, fields = handle.prompt_scores
    logprob, rank, top_ids, top_logprobs = (np.asarray(f) for f in fields)
    results = []
    for s in scored:
        k = s.request.params.prompt_logprobs
        rows = range(s.row, s.row + s.count)
        results.append(
            (
                s.request,
                s.first,
                [
                    TokenLogprob(
                        s.request.prompt_token_ids[s.first + i],
                        float(logprob[r]),
                        [(int(t), float(p)) for t, p in zip(top_ids[r, :k], top_logprobs[r, :k])],
                        int(rank[r]),
                    )
                    for i, r in enumerate(rows)
                ],
            )
        )
    return results


def read_pooled(handle: StepHandle) -> list[tuple[Request, np.ndarray, int]]:
    """Wait for a launched iteration's pooled rows: for each embedding request it pooled for,
    the sum of those rows' final hidden states and their count."""
    if handle.pooled is None:
        return []
    pooled, sums = handle.pooled
    sums = np.asarray(sums)
    return [(p.request, sums[p.segment], len(p.positions)) for p in pooled]
