"""Multi-step decode as a plug-in of the scheduler: the `DecodeLoop` it asks how many decode steps
each decode of an iteration may run in one device loop.

`SingleStep` (`num_scheduler_steps` = 1) runs none; `MultiStepDecode` (K > 1) gives each decode up
to K steps when the iteration holds nothing but unconstrained decodes. The scheduler reserves the
KV slots of the steps it is told (one step when they do not fit) and knows nothing else of the loop;
a chunk's `num_steps` carries the count to the runner's multi-step program and to the engine, which
reads such an iteration at once (`ScheduledChunk.samples_several`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from jaxserve.request import Request
from jaxserve.resolved_config import ResolvedConfig

StepsOf = Callable[[Request], int]


def _one_step(req: Request) -> int:
    return 1


class DecodeLoop(Protocol):
    """How many decode steps each decode of an iteration runs in one device loop."""

    def steps_of(self, decoding: Sequence[Request], decodes_only: Callable[[], bool]) -> StepsOf:
        """Each decode's steps this iteration (1: a plain decode step). `decoding`: the decodes to
        schedule; `decodes_only()`: whether the iteration can hold nothing else (no prompt waits or
        is being chunked, nothing is swapped out or loading, no drafts), asked only when needed."""
        ...


class SingleStep:
    """One decode step per iteration (`num_scheduler_steps` = 1)."""

    def steps_of(self, decoding: Sequence[Request], decodes_only: Callable[[], bool]) -> StepsOf:
        return _one_step


class MultiStepDecode:
    """Up to `num_scheduler_steps` decode steps in one device loop, for an iteration of nothing but
    unconstrained decodes (a grammar's mask depends on the token before it)."""

    def __init__(self, num_scheduler_steps: int, max_model_len: int) -> None:
        self.num_scheduler_steps = num_scheduler_steps
        self.max_model_len = max_model_len

    def steps_of(self, decoding: Sequence[Request], decodes_only: Callable[[], bool]) -> StepsOf:
        if not decoding or any(r.grammar is not None for r in decoding) or not decodes_only():
            return _one_step
        return self.loop_steps

    def loop_steps(self, req: Request) -> int:
        """Decode steps the request may take in one device loop: at most `num_scheduler_steps`, not
        past its length limits, and not across its `min_tokens` (the loop bans its stop tokens
        throughout, or never)."""
        out = len(req.output_token_ids)
        steps = 1
        limit = self.num_scheduler_steps
        if out < req.params.min_tokens:
            limit = min(limit, req.params.min_tokens - out)
        while steps < limit and not req.ends_by_length(out + steps, self.max_model_len):
            steps += 1
        return steps


def build_decode_loop(config: ResolvedConfig) -> DecodeLoop:
    """The decode loop `config` asks for (`num_scheduler_steps`)."""
    if config.num_scheduler_steps > 1:
        return MultiStepDecode(config.num_scheduler_steps, config.max_model_len)
    return SingleStep()
