"""An iteration's programs in the order the runner dispatches them, over a `call(key, *inputs)`
that runs one program variant on the runner's state and returns its outputs.

The model phase (`run_model_steps`) runs the penalty resets of requests that just got a batch row,
then each program's model step (a plain decode step samples its rows in the same program; a
multi-step decode runs its whole loop) with its prompt scores and pooled rows. The sampler phase
(`run_samplers`) samples the logits that the model phase left unsampled: a prefill step's, a decode
step's with constrained rows (their grammar masks written in between, while the steps run), a
verify step's drafts. The programs' rows and batch rows are disjoint, so each phase's order within
itself is all that matters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxserve.runner.prepared_step import Program
from jaxserve.runner.program_args import ProgramArgs
from jaxserve.runner.program_outputs import PooledSums, PromptScoreOutputs
from jaxserve.runner.step_counters import StepCounters
from jaxserve.sampler import SamplerOutput

Call = Callable[..., Any]  # call(key, *inputs) -> the outputs of program variant `key` on the state


@dataclasses.dataclass
class ModelPhase:
    """An iteration after its model phase: per program, its model step's outputs (a multi-step
    decode's: its `SamplerOutput`), the prompt scores and pooled sums of the program with any, and
    the model steps' counters."""

    steps: list[Any]
    scores: PromptScoreOutputs | None = None
    pooled: PooledSums | None = None
    counters: list[StepCounters] = dataclasses.field(default_factory=list)


def run_model_steps(call: Call, args: ProgramArgs, penalty_resets: list[tuple], programs: list[Program]) -> ModelPhase:
    for reset in penalty_resets:
        call(("penalty_reset",), *args.penalty_reset(reset))
    phase = ModelPhase([])
    for program in programs:
        if program.num_steps > 1:
            phase.steps.append(call(program.key, *args.multi_step(program)))
            continue
        step = call(program.key, *args.step(program))
        phase.steps.append(step)
        phase.counters.append(step.counters)
        tokens = step.hidden.shape[0]
        if program.score is not None:
            phase.scores = call(("score", tokens), *args.score(program, step.hidden))
        if program.pool is not None:
            phase.pooled = call(("pool", tokens), *args.pool(program, step.hidden))
    return phase


def run_samplers(call: Call, args: ProgramArgs, phase: ModelPhase, programs: list[Program]) -> list[SamplerOutput]:
    """Each program's sampler output (a verify program's: its `VerifyOutput`); `programs` carry their
    grammar masks written."""
    outs = []
    for program, step in zip(programs, phase.steps):
        if program.num_steps > 1:
            outs.append(step)
        elif program.drafts is not None:
            outs.append(call(("verify_sample", step.logits.shape[0]), *args.verify(program, step.logits)))
        elif program.is_decode and not program.constrained:
            outs.append(step.sampled)
        else:
            outs.append(call(("sample", step.logits.shape[0]), *args.sample(program, step.logits)))
    return outs
