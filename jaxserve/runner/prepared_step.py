"""What the host side of a step builds (`StepInputs`, inputs.py) and the runner runs: the arrays
of one compiled program's call (`Program`) and an iteration's programs (`PreparedStep`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from jaxserve.request import Request
from jaxserve.sampling_tensors import SamplingTensors
from jaxserve.scheduler.output import ScheduledChunk
from jaxserve.structured import GrammarState


class Program(NamedTuple):
    """One compiled step to run: its variant key, host arrays (tokens, positions, attention
    metadata, logits rows, token sources), sampling settings, where its sampled tokens go in
    the iteration's sampled buffer, the persistent batch's row of each of its chunks (the
    batch's spare row for a chunk that samples nothing), and the rows to score against given
    next tokens (prompt log-probabilities: rows and targets, padded to the step's tokens; None
    when none are), for a verify program the drafts its sampler tests, and the constrained rows
    whose token masks are still to be written (`write_token_masks`)."""

    key: tuple
    host_args: tuple
    sampling: SamplingTensors
    sample_offset: int
    batch_rows: np.ndarray
    score: tuple[np.ndarray, np.ndarray] | None = None
    # A verify program (speculative decoding): each row's draft to test and the drafts before it.
    drafts: tuple[np.ndarray, ...] | None = None  # and a draft model's q per row (`verify_program`)
    # Structured output: (sampling row, grammar) of each constrained row. Their mask rows allow
    # every token until `write_token_masks` writes them, after the model step is dispatched.
    masks: tuple[tuple[int, GrammarState], ...] = ()
    constrained: bool = False  # it has (or had, before `write_token_masks`) constrained rows
    # A multi-step decode program: decode steps in its device loop (see `StepInputs.multi_decode`).
    num_steps: int = 1
    # Embeddings: each row's segment among the pooling chunks (`PooledRows`), `pool_segments`
    # for rows no chunk pools; None when none are.
    pool: np.ndarray | None = None

    @property
    def is_decode(self) -> bool:
        """A plain decode program: one row per sequence, sampled in the model step's program."""
        return self.key[0] == "decode"


def write_token_masks(program: Program) -> Program:
    """Write the grammar masks of a program's constrained rows into its sampling tensors, and
    return it without them. The runner calls this once the program's model step is on the
    device, so llguidance's work overlaps the step instead of delaying its launch."""
    for row, grammar in program.masks:
        grammar.write_mask(program.sampling.token_mask[row])
    return program._replace(masks=())


@dataclasses.dataclass
class PromptScores:
    """Which prompt positions a prefill program's scored rows are: `count` rows from `row` in
    its score arrays give `request`'s positions `first`, `first + 1`, ..."""

    request: Request
    row: int
    first: int
    count: int


@dataclasses.dataclass
class PooledRows:
    """The prompt positions of `request` that segment `segment` of a prefill program pools."""

    request: Request
    segment: int
    positions: range


@dataclasses.dataclass
class PreparedStep:
    """An iteration's host work: penalty rows to set first (arguments of each reset call, and
    the requests they are for), then the programs (prefill, with the decodes that join it, then decode or verify) and
    the chunks of each, in the order of its sampling rows."""

    penalty_resets: list[tuple[np.ndarray, ...]]
    reset_requests: list[Request]
    programs: list[Program]
    parts: list[list[ScheduledChunk]]
    prompt_scores: list[PromptScores] = dataclasses.field(default_factory=list)  # of the prefill program
    pooled: list[PooledRows] = dataclasses.field(default_factory=list)  # of the prefill program
