"""The inputs of each program's call, after the state: built from a prepared `Program` (host
arrays, packed in one `HostPack`, and sampling settings), the outputs of the step before it
(logits, hidden states), and small arrays kept on the devices (`DeviceConstants`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxserve.lora.peft import LoraWeights
from jaxserve.runner.host_pack import HostPack
from jaxserve.runner.lora_slots import LoraSlots
from jaxserve.runner.prepared_step import Program


class DeviceConstants:
    """Filled arrays kept on the devices (sampling tables no row of a step uses, the offsets of
    the sampled buffer), so that steps do not ship them from the host."""

    def __init__(self, sharding: Any) -> None:
        self._sharding = sharding
        self._arrays: dict[tuple, jax.Array] = {}

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype, fill: object) -> jax.Array:
        key = (shape, np.dtype(dtype).str, fill)
        array = self._arrays.get(key)
        if array is None:
            array = self._arrays[key] = jax.device_put(np.full(shape, fill, dtype), self._sharding)
        return array


class ProgramArgs:
    """Builds each program's inputs (what follows the state in its call)."""

    def __init__(self, constant: DeviceConstants, lora_slots: LoraSlots | None) -> None:
        self.constant = constant
        self.lora_slots = lora_slots

    def step(self, program: Program) -> tuple:
        """A prefill or verify step's packed host arrays; a decode step's also its sampling, where its
        tokens go in the sampled buffer and whether it samples: a constrained decode step does not
        (nor ship its mask table, written later)."""
        host = HostPack.of(program.host_args)
        if not program.is_decode:
            return (host,)
        sampling = program.sampling
        if program.constrained:
            shape = sampling.token_mask.shape
            sampling = dataclasses.replace(sampling, token_mask=self.constant(shape, np.int32, -1))
        here = self.constant((), np.bool_, not program.constrained)
        return (host, sampling, self.sample_offset(program), here)

    def sample_offset(self, program: Program) -> jax.Array:
        return self.constant((), np.int32, program.sample_offset)  # 0 or decode_offset: not shipped

    def sample(self, program: Program, logits: Any) -> tuple:
        return (logits, program.sampling, self.sample_offset(program))

    def verify(self, program: Program, logits: Any) -> tuple:
        return (logits, program.sampling, HostPack.of(program.drafts))

    @staticmethod
    def multi_step(program: Program) -> tuple:
        return (HostPack.of(program.host_args), program.sampling)

    @staticmethod
    def penalty_reset(reset: tuple[np.ndarray, ...]) -> tuple:
        return (HostPack.of(reset),)

    @staticmethod
    def score(program: Program, hidden: Any) -> tuple:
        return (hidden, HostPack.of(program.score))

    @staticmethod
    def pool(program: Program, hidden: Any) -> tuple:
        return (hidden, HostPack.of(program.pool))

    def lora_write(self, lora_slot: int, weights: LoraWeights | None) -> tuple:
        return (self.constant((), np.int32, lora_slot), self.lora_slots.adapter_arrays(weights))
