"""The persistent batch: a fixed slot per running request, holding what its rows of a step are
built from, in preallocated numpy arrays (row `slot` of each).

A request gets a slot the first time a step samples for it (`Request.batch_slot`) and gives it
back when it stops running (finished, aborted or preempted: it gets a fresh slot when it runs
again). A slot holds:

- the request's sampling settings, written once at join into two rows: one for while its stop
  tokens are banned (before `min_tokens`), one for after;
- where its next decode starts: the position of its last token (`positions`, num_tokens - 1) and
  that token (`tokens`), or, while only the device has it, the row of the last launch's sampled
  tokens that holds it (`token_src`; `tokens` is then PLACEHOLDER). Written at join, then moved
  on as steps are launched (`launched`: one more token for each slot a step samples for) and
  read (`read`: the token itself, and the tokens beyond the first of a verify or multi-step row);
- its block-table row and how much of it is valid, copied from the KV manager's table as its
  decodes are scheduled (`sync_tables`): whole at the first, then the new entries when the
  sequence gained blocks, and the whole row again only when the manager changed entries (its
  table version moved: a block swapped for the cache's copy, swap, released blocks).

A step's arrays are then gathers of slot rows by one index array, plus vectorized arithmetic,
however the batch changed since the last step. The gathers make fresh arrays, so an array handed
to a step still in flight is never written. Row `spare` (= num_slots) is the padding row: greedy
sampling, no penalties or bias, token 0 at position 0, a block table of block 0.

The slot is also the request's row of the device's PenaltyCounts (`unset`: requests with
penalties whose row is not set from their history yet).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxserve.request import PLACEHOLDER, Request, RequestStatus
from jaxserve.sampling_tensors import BIAS_SLOTS, RowSampling, SamplingTensors
from jaxserve.scheduler.output import ScheduledChunk

STOP_ID_SLOTS = 8  # stop token ids per row that a multi-step decode checks on the device


class InputBatch:
    """Slots 0..num_slots-1 for running requests and the padding row `spare` (= num_slots).
    Sampling row of slot s: s, or s + num_slots + 1 while the request's stop tokens are still
    banned. Block-table rows are `max_blocks` wide, zeros past each row's valid length."""

    def __init__(
        self,
        num_slots: int,
        constant: Callable[[tuple[int, ...], np.dtype, object], Any],
        mask_words: int,
        max_blocks: int,
    ):
        self.spare = num_slots
        self.constant = constant  # device-resident filled arrays (bias and mask tables no row uses)
        self.mask_words = mask_words
        self._free = list(range(num_slots - 1, -1, -1))
        self._owners: list[Request | None] = [None] * num_slots  # the request in each slot
        self.unset: set[Request] = set()  # with penalties, their PenaltyCounts row not set yet
        rows = 2 * (num_slots + 1)
        # Each sampling row's SamplingTensors settings (their positions stay 0: a step writes its
        # own) and logit bias tables; the token masks are written per step by structured output.
        padding = SamplingTensors.build([None] * rows, rows, self.spare)
        self._settings, self._bias_ids, self._bias_values = padding.settings, padding.bias_ids, padding.bias_values
        self._biased = np.zeros(rows, np.bool_)  # rows with a logit bias or banned tokens
        slots = num_slots + 1
        self.positions = np.zeros(slots, np.int32)
        self.tokens = np.zeros(slots, np.int32)
        self.token_src = np.full(slots, -1, np.int32)
        self._launch = np.zeros(slots, np.int64)  # the launch that last sampled for the slot (0: none)
        self.tables = np.zeros((slots, max_blocks), np.int32)
        self._table_lens = np.zeros(slots, np.int64)
        self._table_versions = np.full(slots, -1, np.int64)  # of the table each row copies
        self._stops_from = np.zeros(slots, np.int32)  # num_tokens from which its stop tokens count
        self._stop_ids = np.full((slots, STOP_ID_SLOTS), -1, np.int32)
        self.constrained = np.zeros(slots, np.bool_)  # structured output (a grammar)

    def __len__(self) -> int:
        return self.spare - len(self._free)

    @staticmethod
    def slot(req: Request) -> int:
        if req.batch_slot is None:
            raise KeyError(f"request {req.request_id} has no slot")
        return req.batch_slot

    def slots(self, requests: Sequence[Request]) -> np.ndarray:
        """The requests' slots, as one index array."""
        return np.fromiter(map(self.slot, requests), np.intp, len(requests))

    def release_finished(self) -> None:
        """Take the slots back from requests that stopped running."""
        for slot, req in enumerate(self._owners):
            if req is not None and req.status is not RequestStatus.RUNNING:
                req.batch_slot = self._owners[slot] = None
                self._free.append(slot)
                self.unset.discard(req)

    def join(self, req: Request) -> None:
        """Give a running request a slot and write its rows (no-op if it has one). Raises,
        holding nothing, for settings that cannot be built."""
        if req.batch_slot is not None:
            return
        slot = self._free[-1]
        penalty_slot = slot if req.params.has_penalties else -1
        built = SamplingTensors.build(
            [
                RowSampling(req.params, req.seed, 0, penalty_slot=penalty_slot),
                RowSampling(req.params, req.seed, 0, banned_ids=tuple(req.stop_token_ids), penalty_slot=penalty_slot),
            ],
            2,
            self.spare,
        )
        self._free.pop()
        req.batch_slot, self._owners[slot] = slot, req
        rows = [slot, slot + self.spare + 1]
        self._settings[rows] = built.settings
        self._bias_ids[rows] = built.bias_ids
        self._bias_values[rows] = built.bias_values
        self._biased[rows] = (built.bias_ids >= 0).any(axis=1)
        if req.params.has_penalties:
            self.unset.add(req)
        self.positions[slot] = req.num_tokens - 1
        self.tokens[slot] = req.last_token_id
        self.token_src[slot] = -1
        self._launch[slot] = 0
        self._stops_from[slot] = req.num_prompt_tokens + req.params.min_tokens
        ids = sorted(req.stop_token_ids)[:STOP_ID_SLOTS]
        self._stop_ids[slot] = -1
        self._stop_ids[slot, : len(ids)] = ids
        self.constrained[slot] = req.grammar is not None

    def sync_tables(self, slots: np.ndarray, chunks: Sequence[ScheduledChunk]) -> None:
        """Bring the block-table rows of the chunks' slots up to their tables: the entries past
        a row's length where the table only grew, the whole row where its version changed."""
        n = len(chunks)
        versions = np.fromiter((c.table_version for c in chunks), np.int64, n)
        lengths = np.fromiter((len(c.block_table) for c in chunks), np.int64, n)
        rewrite = (versions != self._table_versions[slots]) | (versions < 0)
        grown = lengths > self._table_lens[slots]
        for i in np.flatnonzero(rewrite | grown).tolist():
            slot, table, length = slots[i], chunks[i].block_table, lengths[i]
            if rewrite[i]:
                self.tables[slot, length:] = 0
                self.tables[slot, :length] = table
            else:
                start = self._table_lens[slot]
                self.tables[slot, start:length] = table[start:]
        self._table_versions[slots] = versions
        self._table_lens[slots] = lengths

    def stop_ids(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots), STOP_ID_SLOTS] stop token ids of each slot's next token: none (-1) while
        its stop tokens are banned (before `min_tokens`)."""
        free = self.positions[slots] + 1 >= self._stops_from[slots]
        return np.where(free[:, None], self._stop_ids[slots], -1)

    def launched(self, launch: int, parts: Sequence[tuple[np.ndarray, int | None]]) -> None:
        """Launch number `launch` (> 0, increasing) is on the device. `parts`: for each of its
        programs, the slot of each chunk (spare for one that samples nothing), and the row of the
        launch's sampled tokens where its first chunk's token lands (the others' follow), or None
        (verify and multi-step programs, read at once). Each slot sampled for gains a token that
        only the device knows; the previous launch's sampled tokens are no longer readable."""
        self.token_src[:] = -1
        for slots, first_row in parts:
            sampled = np.flatnonzero(slots != self.spare)
            held = slots[sampled]
            self.positions[held] += 1
            self.tokens[held] = PLACEHOLDER
            self._launch[held] = launch
            if first_row is not None:
                self.token_src[held] = first_row + sampled

    def read(self, launch: int, slots: np.ndarray, tokens: np.ndarray) -> None:
        """The tokens a program of launch `launch` sampled were read: [rows] or [rows, k] (a
        verify or multi-step program; -1 after a row's last token), row i for slot `slots[i]`.
        A slot that no later launch sampled for, and that no other request took since, knows its
        last token, and is as many tokens further as the row holds beyond its first."""
        rows = tokens.reshape(tokens.shape[0], -1)[: len(slots)]
        held = np.flatnonzero(self._launch[slots] == launch)
        if not len(held):
            return
        slots, rows = slots[held], rows[held]
        ended = rows < 0
        counts = np.where(ended.any(axis=1), ended.argmax(axis=1), rows.shape[1])
        self.tokens[slots] = rows[np.arange(len(rows)), counts - 1]
        self.token_src[slots] = -1
        self.positions[slots] += counts - 1

    def sampling(
        self, rows: np.ndarray, slots: np.ndarray, ahead: np.ndarray | int, num_rows: int, masked: bool
    ) -> SamplingTensors:
        """Sampling tensors of `num_rows` rows: row `rows[i]` samples the token `ahead[i]` places
        after the next one of the request in slot `slots[i]` (a verified draft's); the other rows
        are padding. `masked`: some row has a token mask (structured output), so the mask table
        is a host array of allow-all rows for those masks to be written into."""
        index = np.full(num_rows, self.spare, np.intp)
        sampled = self.positions[slots] + 1 + ahead  # the positions of the tokens sampled
        banned = sampled < self._stops_from[slots]  # no stop token yet
        index[rows] = slots + banned * (self.spare + 1)
        if self._biased[index].any():
            bias_ids, bias_values = self._bias_ids[index], self._bias_values[index]
        else:
            bias_ids = self.constant((num_rows, BIAS_SLOTS), np.int32, -1)
            bias_values = self.constant((num_rows, BIAS_SLOTS), np.float32, 0.0)
        shape = (num_rows, self.mask_words)
        token_mask = np.full(shape, -1, np.int32) if masked else self.constant(shape, np.int32, -1)
        t = SamplingTensors(self._settings[index], bias_ids, bias_values, token_mask)
        t.positions[rows] = sampled
        return t
