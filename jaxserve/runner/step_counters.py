"""What a model step counts besides its results, and the runner's running totals of it.

A model step's program returns `StepCounters` next to its logits: a mixture-of-experts model's
token-to-expert assignments per expert, and under pipeline stages the schedule the stages ran
(`sharding.pipeline_schedule`: [P, ticks], the micro-batch each stage ran per tick, -1 idle).
They are copied to the host with the step's tokens and added up (`StepTotals`) when the runner reads them
(`ModelRunner.fetch`): no extra wait on the device. Multi-step decode loops are not counted.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np


class StepCounters(NamedTuple):
    expert_load: jax.Array  # [X] int32 (all layers); [0] for a dense model
    pipeline_ticks: jax.Array  # [P, ticks] int32; [0, 0] without pipeline stages


class PipelineTicks:
    """Stage-ticks since the start: per stage, the ticks it ran a micro-batch (busy), and the ticks
    every stage went through (`ticks`, the same for each); idle = ticks - busy, the bubble."""

    def __init__(self, num_stages: int) -> None:
        self.busy = np.zeros(num_stages, np.int64)
        self.ticks = 0

    def add(self, schedule: np.ndarray) -> None:
        """One step's [P, ticks] schedule."""
        self.busy += np.count_nonzero(schedule >= 0, axis=1)
        self.ticks += schedule.shape[1]


class StepTotals:
    """The runner's totals of the model steps read: a mixture-of-experts model's token-to-expert
    assignments per expert (all layers) of the last iteration read and since the start, and the
    pipeline stages' ticks (no stages: none). Multi-step decode loops are not counted."""

    def __init__(self, num_experts: int, num_stages: int) -> None:
        self.last_expert_load = np.zeros(num_experts, np.int64)
        self.expert_tokens = np.zeros(num_experts, np.int64)
        self.pipeline_ticks = PipelineTicks(num_stages)

    @property
    def counts_anything(self) -> bool:
        return bool(self.expert_tokens.size) or bool(self.pipeline_ticks.busy.size)

    def add(self, counters: list[StepCounters]) -> None:
        """A fetched iteration's model-step counters (already on the host)."""
        if not counters:
            return
        if self.expert_tokens.size:
            self.last_expert_load = sum(np.asarray(c.expert_load, np.int64) for c in counters)
            self.expert_tokens += self.last_expert_load
        if self.pipeline_ticks.busy.size:
            for c in counters:
                self.pipeline_ticks.add(np.asarray(c.pipeline_ticks))
