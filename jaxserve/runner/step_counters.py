"""What a model step counts besides its results, and the runner's running totals of it.

A model step's program returns `StepCounters` next to its logits: a mixture-of-experts model's
token-to-expert assignments per expert, and under pipeline stages the schedule the stages ran
(`sharding.pipeline_schedule`: [P, ticks], the micro-batch each stage ran per tick, -1 idle).
They are copied to the host with the step's tokens and added up when the runner reads them
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
