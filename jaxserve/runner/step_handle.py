"""A launched iteration (`StepHandle`) and its reads: `start_reads` starts copying what its
programs gave back to the host, `read_tokens` waits for its sampled tokens (and updates the
persistent batch), `read_prompt_scores` and `read_pooled` for its prompt scores and pooled rows,
`read_hidden` for its rows' last hidden states (MTP speculation only)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.outputs import SampledToken, TokenLogprob
from jaxserve.request import Request
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.iteration import ModelPhase
from jaxserve.runner.prepared_step import PooledRows, PreparedStep, Program, PromptScores
from jaxserve.runner.step_counters import StepCounters
from jaxserve.sampler import SamplerOutput
from jaxserve.scheduler.output import ScheduledChunk
from jaxserve.speculative.hidden_rows import HiddenRows


@dataclasses.dataclass
class StepHandle:
    """A launched iteration: for each of its programs, the chunks, their batch rows in the persistent
    batch and the sampler outputs the host will read (tokens; log-probabilities only when a
    chunk asked for them). Between `ModelRunner.run_model` and `run_sampler` it holds its
    prepared step (`awaits_masks`: some rows wait for grammar masks)."""

    launch_index: int  # 1 for the runner's first launch
    parts: list[tuple[list[ScheduledChunk], np.ndarray, tuple[jax.Array, ...]]]
    launches_before_fetch: int = 0  # set by fetch: > launch_index when the next one went first
    # The prefill program's scored prompt positions and their (logprob, rank, top ids, top logprobs).
    prompt_scores: tuple[list[PromptScores], tuple[jax.Array, ...]] | None = None
    # The prefill program's pooled rows (embeddings) and the sum of each segment's rows.
    pooled: tuple[list[PooledRows], jax.Array] | None = None
    # Each model step's counters (not multi-step loops), when the runner counts anything.
    counters: list[StepCounters] = dataclasses.field(default_factory=list)
    # MTP speculation: per model step (not multi-step loops), its chunks, each one's first row in its
    # last hidden states, and those states [T, E].
    hidden: list[tuple[list[ScheduledChunk], list[int], jax.Array]] = dataclasses.field(default_factory=list)
    # The iteration's host work, until its samplers are dispatched.
    prepared: PreparedStep | None = None

    @property
    def awaits_masks(self) -> bool:
        return self.prepared is not None and any(p.masks for p in self.prepared.programs)


def start_reads(
    handle: StepHandle,
    batch: InputBatch,
    phase: ModelPhase,
    outs: list[SamplerOutput],
    counted: bool,
    keep_hidden: bool = False,
) -> None:
    """Record a dispatched iteration in the persistent batch and start copying to the host what
    the host will read of it: the tokens (log-probabilities only when a chunk asked), the prompt
    scores, the pooled sums, (when `counted`) the model steps' counters and (when `keep_hidden`)
    the model steps' last hidden states."""
    prepared, handle.prepared = handle.prepared, None
    batch.unset.difference_update(prepared.reset_requests)
    # The tokens of decode and prefill programs land in the sampled buffer, at their offsets.
    batch.launched(
        handle.launch_index,
        [(p.batch_rows, p.sample_offset if p.drafts is None and p.num_steps == 1 else None) for p in prepared.programs],
    )
    for chunks, program, out in zip(prepared.parts, prepared.programs, outs):
        wanted = max(
            (c.request.params.logprobs for c in chunks if c.sample and c.request.params.logprobs is not None),
            default=None,
        )
        fields = (out.tokens,) if wanted is None else (out.tokens, out.logprobs) if wanted == 0 else tuple(out)
        for field in fields:
            field.copy_to_host_async()
        handle.parts.append((chunks, program.batch_rows, fields))
    if phase.scores is not None:
        scores = phase.scores.fields()
        for field in scores:
            field.copy_to_host_async()
        handle.prompt_scores = (prepared.prompt_scores, scores)
    if phase.pooled is not None:
        phase.pooled.sums.copy_to_host_async()
        handle.pooled = (prepared.pooled, phase.pooled.sums)
    if keep_hidden:
        for chunks, program, step in zip(prepared.parts, prepared.programs, phase.steps):
            if program.num_steps == 1:
                # EAGLE-3 reads the aux layers' states (a model built with them), MTP the last hidden state
                hidden = step.aux_hidden if step.aux_hidden.shape[-1] else step.hidden
                hidden.copy_to_host_async()
                handle.hidden.append((chunks, _first_rows(chunks, program), hidden))
    handle.counters = phase.counters if counted else []
    for counters in handle.counters:
        for field in counters:
            field.copy_to_host_async()


def read_tokens(handle: StepHandle, batch: InputBatch) -> list[tuple[ScheduledChunk, list[SampledToken]]]:
    """Wait for a launched iteration and read the tokens (and log-probabilities, if asked) that
    each of its sampling chunks produced: one, or for a verified decode its accepted drafts
    and the token after them, or a multi-step decode's tokens."""
    results = []
    for chunks, batch_rows, fields in handle.parts:
        tokens, *rest = (np.asarray(f) for f in fields)
        batch.read(handle.launch_index, batch_rows, tokens)
        width = tokens.shape[1] if tokens.ndim == 2 else 1  # [B, k + 1] or [B, K]: verify, multi-step
        token_rows = tokens.reshape(-1, width).tolist()
        # Other fields are by row (a verified chunk's rows follow each other). Python floats
        # once per field: a numpy scalar per row costs more than the rest of the loop.
        logprobs = rest[0].tolist() if rest else None
        top_ids, top_logprobs = (rest[1], rest[2]) if len(rest) == 3 else (None, None)
        for i, c in enumerate(chunks):
            if not c.sample:
                continue
            sampled = []
            for j, token in enumerate(token_rows[i]):
                if token < 0:
                    break
                row = i * width + j
                lp = logprobs[row] if logprobs is not None else _NAN
                if top_ids is None:
                    sampled.append(SampledToken(token, lp, _NO_TOP_IDS, _NO_TOP_LOGPROBS))
                else:
                    sampled.append(SampledToken(token, lp, top_ids[row], top_logprobs[row]))
            results.append((c, sampled))
    return results


_NAN = float("nan")
_NO_TOP_IDS = np.zeros(0, np.int32)
_NO_TOP_LOGPROBS = np.zeros(0, np.float32)


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


def _first_rows(chunks: list[ScheduledChunk], program: Program) -> list[int]:
    """Each chunk's first row in a model step: a verify program's sequences take the same rows each, the
    others' chunks their new tokens one after another (a prefill program's decodes one each, after its chunks)."""
    if program.drafts is not None:
        per_seq = len(program.host_args[0]) // program.key[1]
        return [i * per_seq for i in range(len(chunks))]
    return np.cumsum([0] + [c.num_new_tokens for c in chunks[:-1]]).tolist()


def read_hidden(handle: StepHandle, results: list[tuple[ScheduledChunk, list[SampledToken]]]) -> list[HiddenRows]:
    """A read iteration's last hidden states (kept when `start_reads` was asked to): per chunk, its request,
    its first position and the f32 rows of the positions whose tokens stand (a verified decode's: its last
    token and the drafts accepted, one row per token it sampled; `results` from `read_tokens`)."""
    sampled = {id(c): len(tokens) for c, tokens in results}
    out = []
    for chunks, first_rows, hidden in handle.hidden:
        rows = np.asarray(hidden, np.float32)
        for c, first in zip(chunks, first_rows):
            n = sampled.get(id(c), 0) if c.draft else c.num_new_tokens
            if n:
                out.append(HiddenRows(c.request, c.start, rows[first : first + n]))
    return out
