"""The persistent batch: a fixed slot per running request, holding its sampling rows.

A request gets a slot the first time a step samples for it and gives it back when it stops running
(finished, aborted or preempted: it gets a fresh slot when it runs again). At join its
sampling settings are written once into the slot's two rows of preallocated arrays: one for
while its stop tokens are banned (before `min_tokens`), one for after. A step's sampling
tensors are then one gather of slot rows per field, however its batch changed since the last
step; only the positions are new each step. The gather makes fresh arrays, so an array handed
to a step still in flight is never written.

The slot is also the request's row of the device's PenaltyCounts (`unset`: requests with
penalties whose row is not set from their history yet). The block-table rows stay with the
KV manager, which keeps each sequence's table as a preallocated array updated in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxserve import faults
from jaxserve.request import Request, RequestStatus
from jaxserve.sampler import BIAS_SLOTS, RowSampling, SamplingTensors

# The SamplingTensors fields a slot holds (the positions are per step, the token masks are
# written per step by structured output).
SLOT_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "seed", "num_logprobs", "penalty_slots", "bias_ids", "bias_values")


class InputBatch:
    """Slots 0..num_slots-1 for running requests; row `spare` (= num_slots) is the padding row
    (greedy, no penalties, no bias). Sampling row of slot s: s, or s + num_slots + 1 while the
    request's stop tokens are still banned."""

    def __init__(self, num_slots: int, constant: Callable[[tuple[int, ...], np.dtype, object], Any],
                 mask_words: int):
        self.spare = num_slots
        self.constant = constant  # device-resident filled arrays (bias and mask tables no row uses)
        self.mask_words = mask_words
        self._free = list(range(num_slots - 1, -1, -1))
        self._slots: dict[Request, int] = {}
        self.unset: set[Request] = set()  # with penalties, their PenaltyCounts row not set yet
        rows = 2 * (num_slots + 1)
        padding = SamplingTensors.build([None] * rows, rows, self.spare)
        self._rows = {name: getattr(padding, name) for name in SLOT_FIELDS}
        self._biased = np.zeros(rows, np.bool_)  # rows with a logit bias or banned tokens

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, req: Request) -> int:
        return self._slots[req]

    def release_finished(self) -> None:
        for req in [r for r in self._slots if r.status is not RequestStatus.RUNNING]:
            self._free.append(self._slots.pop(req))
            self.unset.discard(req)

    def join(self, req: Request) -> None:
        """Give a running request a slot and write its sampling rows (no-op if it has one).
        Raises, holding nothing, for settings that cannot be built."""
        if req in self._slots:
            return
        slot = self._free[-1]
        penalty_slot = slot if req.params.has_penalties else -1
        built = SamplingTensors.build(
            [RowSampling(req.params, req.seed, 0, penalty_slot=penalty_slot),
             RowSampling(req.params, req.seed, 0, banned_ids=tuple(req.stop_token_ids), penalty_slot=penalty_slot)],
            2, self.spare)
        self._free.pop()
        self._slots[req] = slot
        rows = [slot, slot + self.spare + 1]
        for name in SLOT_FIELDS:
            self._rows[name][rows] = getattr(built, name)
        self._biased[rows] = (built.bias_ids >= 0).any(axis=1)
        if req.params.has_penalties:
            self.unset.add(req)

    def sampling(self, rows: Sequence[tuple[int, Request, int]], num_rows: int, masked: bool) -> SamplingTensors:
        """Sampling tensors of `num_rows` rows: each of `rows` is (row, request, ahead), sampling
        the request's token `ahead` places after its next one (a verified draft's); the other
        rows are padding. `masked`: some row has a token mask (structured output), so the mask
        table is a host array of allow-all rows for those masks to be written into."""
        index = np.full(num_rows, self.spare, np.intp)
        positions = np.zeros(num_rows, np.int32)
        for row, req, ahead in rows:
            faults.check("sampling", req)
            banned = len(req.output_token_ids) + ahead < req.params.min_tokens  # no stop token yet
            index[row] = self._slots[req] + banned * (self.spare + 1)
            positions[row] = req.num_tokens + ahead
        fields = {name: self._rows[name][index] for name in SLOT_FIELDS}
        if not self._biased[index].any():
            fields["bias_ids"] = self.constant((num_rows, BIAS_SLOTS), np.int32, -1)
            fields["bias_values"] = self.constant((num_rows, BIAS_SLOTS), np.float32, 0.0)
        shape = (num_rows, self.mask_words)
        token_mask = np.full(shape, -1, np.int32) if masked else self.constant(shape, np.int32, -1)
        return SamplingTensors(positions=positions, token_mask=token_mask, **fields)
