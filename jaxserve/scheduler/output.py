"""What the scheduler hands the runner for one step (plain Python + numpy)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.kv import CopyStage
from jaxserve.request import Request


@dataclasses.dataclass
class ScheduledChunk:
    """One request's work this step: compute `num_new_tokens` tokens from `start`.

    The tokens are `request.copy_tokens(start, start + num_new_tokens)`; `block_table` covers
    every position below `start + num_new_tokens`, and `table_version` is the KV manager's
    version of its entries (`KVHandle.version`; -1, unknown, for a chunk built by
    hand: the runner copies the whole table). `sample` is true when this chunk reaches the
    request's last token, so the step must sample the next one.
    """

    request: Request
    start: int
    num_new_tokens: int
    block_table: np.ndarray  # int32
    sample: bool
    output_index: int = -1  # where its sampled token goes in request.output_token_ids (at launch)
    # Speculative decoding (decodes only): draft tokens verified after the last token; their
    # KV slots are allocated, and the ones rejected are released when the step is read.
    draft: list[int] = dataclasses.field(default_factory=list)
    # With a draft model at temperature > 0: q, the distribution each draft token was drawn from [len(draft), V]
    # (rejection sampling needs it); None: deterministic drafts.
    draft_probs: np.ndarray | None = None
    # Multi-step decode (decodes only): tokens this decode may sample in the step's device loop
    # (its KV slots are allocated); it stops earlier at a stop token.
    num_steps: int = 1
    table_version: int = -1

    @property
    def samples_several(self) -> bool:
        """It may sample several tokens (drafts to verify, or a multi-step decode loop): how many
        is known only once the step is read."""
        return bool(self.draft) or self.num_steps > 1

    @property
    def token_ids(self) -> list[int]:
        return self.request.copy_tokens(self.start, self.start + self.num_new_tokens)


@dataclasses.dataclass
class SchedulerOutput:
    """A step: prefill chunks (ragged step) and decodes (one token each), plus block moves.

    The runner first executes `copy_stages` in order (swap-out, swap-in, prefix-cache spill/reload
    and disk-write copies planned by the KV manager), then the model.
    """

    prefills: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    decodes: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    copy_stages: list[CopyStage] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.decodes or self.copy_stages)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.prefills) + sum(1 + len(c.draft) for c in self.decodes)

    @property
    def is_speculative(self) -> bool:
        return any(c.draft for c in self.decodes)

    @property
    def samples_several(self) -> bool:
        """Some decode may sample several tokens (`ScheduledChunk.samples_several`): where the
        next step of its request starts is known only once this step is read."""
        return any(c.samples_several for c in self.decodes)
