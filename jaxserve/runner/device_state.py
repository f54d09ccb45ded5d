"""The runner's one device state: everything its programs read and update on the devices.

Every program is a pure function `(state, inputs) -> (state, outputs)`. It takes the state's
updatable part over (donated: updated in place) and reads the parameters, which no program changes:
passed, not donated, as an executable copies a parameter it returns and a donated one costs host
time per array per call (`Executables.run` splits and joins the state around each call).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxserve.model import KVCache
from jaxserve.sampling_tensors import PenaltyCounts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """The sampler's device state: the penalty counts of each batch row, and two buffers of
    sampled tokens at fixed rows (`StepInputs.sampled_rows`): the previous iteration's, whose
    tokens this iteration's steps read in place of their placeholders, and this iteration's,
    which its samplers write. An iteration's start swaps them (`next_iteration`): rows it does
    not write keep stale tokens that no later step reads."""

    penalty_counts: PenaltyCounts
    prev_sampled: jax.Array  # i32[sampled_rows]
    sampled: jax.Array  # i32[sampled_rows]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    """The parameters, the LoRA adapters' LoRA slots (None without LoRA; split like the
    projections they update), the KV cache and the sampler's state."""

    params: Any
    adapters: Any
    cache: KVCache
    sampler: SamplerState

    def updatable(self) -> tuple[Any, KVCache, SamplerState]:
        """What programs update (all but the parameters), as one donated argument."""
        return (self.adapters, self.cache, self.sampler)

    def join(self, updated: tuple[Any, KVCache, SamplerState]) -> DeviceState:
        """This state with a program's update of `updatable()`."""
        return DeviceState(self.params, *updated)

    def with_cache(self, cache: KVCache) -> DeviceState:
        return dataclasses.replace(self, cache=cache)

    def with_sampler(self, sampler: SamplerState) -> DeviceState:
        return dataclasses.replace(self, sampler=sampler)

    def with_counts(self, penalty_counts: Any) -> DeviceState:
        return self.with_sampler(dataclasses.replace(self.sampler, penalty_counts=penalty_counts))

    def next_iteration(self) -> DeviceState:
        """The state an iteration starts from: the last iteration's sampled tokens become the
        ones its steps read, and their old buffer the one it writes."""
        s = self.sampler
        return self.with_sampler(dataclasses.replace(s, prev_sampled=s.sampled, sampled=s.prev_sampled))


def state_shardings(params: Any, adapters: Any, cache: Any, replicated: Any) -> DeviceState:
    """Where each part of the state lies: `params`, `adapters` and `cache` are those parts'."""
    counts = PenaltyCounts(replicated, replicated)
    return DeviceState(params, adapters, cache, SamplerState(counts, replicated, replicated))
