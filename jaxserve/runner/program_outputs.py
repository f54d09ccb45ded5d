"""What the runner's programs return next to the updated `DeviceState`: named pytrees, read by
field (a sampler's output is `SamplerOutput`, a verify sampler's `VerifyOutput`)."""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.runner.step_counters import StepCounters
from jaxserve.sampler import SamplerOutput


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelStepOutputs:
    """A model step's logits at its logits rows (padded to the sampler's row bucket, zeros, for
    prefill steps), every row's last hidden state (prompt scores, pooling), its counters, and every
    row's residual stream entering the model's aux layers (EAGLE-3 speculation, [T, A * E]; [T, 0] without)."""

    logits: jax.Array
    hidden: jax.Array
    counters: StepCounters
    aux_hidden: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStepOutputs(ModelStepOutputs):
    """A decode step's outputs and its sampler's (empty when the step left sampling to the sampler
    program: a step with constrained rows, whose masks are written after it is dispatched)."""

    sampled: SamplerOutput


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptScoreOutputs:
    """Per scored row: the log-probability and rank of its target token, and the most likely
    tokens there with their log-probabilities (prompt log-probabilities)."""

    logprob: jax.Array  # f32[R]
    rank: jax.Array  # i32[R]
    top_ids: jax.Array  # i32[R, MAX_LOGPROBS]
    top_logprobs: jax.Array  # f32[R, MAX_LOGPROBS]

    def fields(self) -> tuple[jax.Array, ...]:
        return (self.logprob, self.rank, self.top_ids, self.top_logprobs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PooledSums:
    """Embeddings: per pooling segment, the sum of its rows' final hidden states (f32)."""

    sums: jax.Array  # f32[segments, hidden]
