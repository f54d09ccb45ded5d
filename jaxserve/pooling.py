"""What an embedding request (`SamplingParams.pooling`) gathers while its prompt is prefilled: the
sum and count of the prompt rows' final hidden states that its steps pooled (no JAX here).

Each prefill step that runs part of the prompt pools the rows no earlier launched step pools (a
recompute after preemption computes some rows again; they count once), and the runner returns
their sum (`runner.read_pooled`). Mean pooling needs every prompt row, so a prefix-cache hit
may cover only the rows already pooled (`Request.num_cacheable_tokens`); last-token pooling needs
the last row only, which is always computed.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PromptPooling:
    kind: str  # "last" or "mean" (`sampling_params.POOLING_KINDS`)
    launched: int = 0  # prompt positions below this are pooled by launched steps
    total: np.ndarray | None = None  # sum of the pooled rows read so far (float64)
    rows: int = 0

    def positions(self, start: int, count: int, num_prompt: int) -> range:
        """The prompt positions that a chunk computing [start, start + count) pools."""
        first = max(start, self.launched) if self.kind == "mean" else max(start, self.launched, num_prompt - 1)
        return range(first, min(start + count, num_prompt))

    def first_needed(self, num_prompt: int) -> int | None:
        """The first prompt position whose row a step must compute, not take from the prefix
        cache: for mean pooling, the first not pooled yet; None when the cache may cover any."""
        return self.launched if self.kind == "mean" and self.launched < num_prompt else None

    def on_launched(self, positions: range) -> None:
        self.launched = max(self.launched, positions.stop)

    def add(self, total: np.ndarray, rows: int) -> None:
        """The sum of `rows` pooled rows, read from a step."""
        total = total.astype(np.float64)
        self.total = total if self.total is None else self.total + total
        self.rows += rows

    def vector(self) -> np.ndarray:
        """The pooled vector (float32): the last row, or the mean of all rows."""
        if self.total is None or self.rows == 0:
            raise ValueError("no prompt row was pooled")
        return (self.total / self.rows).astype(np.float32)
