"""The persistent batch: a fixed batch row per running request, holding what its rows of a step are
built from, in preallocated numpy arrays (row `batch_row` of each).

A request gets a batch row the first time a step samples for it (`Request.batch_row`) and gives it
back when it stops running (finished, aborted or preempted: it gets a fresh batch row when it runs
again). A batch row holds:

- the request's sampling settings, written once at join into two rows: one for while its stop
  tokens are banned (before `min_tokens`), one for after;
- where its next decode starts: the position of its last token (`positions`, num_tokens - 1) and
  that token (`tokens`), or, while only the device has it, the row of the last launch's sampled
  tokens that holds it (`token_src`; `tokens` is then PLACEHOLDER). Written at join, then moved
  on as steps are launched (`launched`: one more token for each batch row a step samples for) and
  read (`read`: the token itself, and the tokens beyond the first of a verify or multi-step row);
- its block-table row and how much of it is valid, copied from the KV manager's table as its
  decodes are scheduled (`sync_tables`): whole at the first, then the new entries when the
  sequence gained blocks, and the whole row again only when the manager changed entries (its
  table version moved: a block swapped for the cache's copy, swap, released blocks).

A step's arrays are then gathers of batch rows by one index array, plus vectorized arithmetic,
however the batch changed since the last step. The gathers make fresh arrays, so an array handed
to a step still in flight is never written. Row `spare` (= num_batch_rows) is the padding row: greedy
sampling, no penalties or bias, token 0 at position 0, a block table of block 0.

The batch row is also the request's row of the device's PenaltyCounts (`unset`: requests with
penalties whose row is not set from their history yet).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxserve.request import PLACEHOLDER, Request, RequestStatus
from jaxserve.sampling_tensors import BIAS_WIDTH, RowSampling, SamplingTensors
from jaxserve.scheduler.output import ScheduledChunk

STOP_ID_WIDTH = 8  # stop token ids per row that a multi-step decode checks on the device


class InputBatch:
    """Batch rows 0..num_batch_rows-1 for running requests and the padding row `spare` (= num_batch_rows).
    Sampling row of batch row s: s, or s + num_batch_rows + 1 while the request's stop tokens are still
    banned. Block-table rows are `max_blocks` wide, zeros past each row's valid length."""

    def __init__(
        self,
        num_batch_rows: int,
        constant: Callable[[tuple[int, ...], np.dtype, object], Any],
        mask_words: int,
        max_blocks: int,
    ):
        self.spare = num_batch_rows
        self.constant = constant  # device-resident filled arrays (bias and mask tables no row uses)
        self.mask_words = mask_words
        self._free = list(range(num_batch_rows - 1, -1, -1))
        self._owners: list[Request | None] = [None] * num_batch_rows  # the request in each batch row
        self.unset: set[Request] = set()  # with penalties, their PenaltyCounts row not set yet
        rows = 2 * (num_batch_rows + 1)
        # Each sampling row's SamplingTensors settings (their positions stay 0: a step writes its
        # own) and logit bias tables; the token masks are written per step by structured output.
        padding = SamplingTensors.build([None] * rows, rows, self.spare)
        self._settings, self._bias_ids, self._bias_values = padding.settings, padding.bias_ids, padding.bias_values
        self._biased = np.zeros(rows, np.bool_)  # rows with a logit bias or banned tokens
        batch_rows = num_batch_rows + 1
        self.positions = np.zeros(batch_rows, np.int32)
        self.tokens = np.zeros(batch_rows, np.int32)
        self.token_src = np.full(batch_rows, -1, np.int32)
        self._launch = np.zeros(batch_rows, np.int64)  # the launch that last sampled for the batch row (0: none)
        self.tables = np.zeros((batch_rows, max_blocks), np.int32)
        self._table_lens = np.zeros(batch_rows, np.int64)
        self._table_versions = np.full(batch_rows, -1, np.int64)  # of the table each row copies
        self._stops_from = np.zeros(batch_rows, np.int32)  # num_tokens from which its stop tokens count
        self._stop_ids = np.full((batch_rows, STOP_ID_WIDTH), -1, np.int32)
        self.constrained = np.zeros(batch_rows, np.bool_)  # structured output (a grammar)

    def __len__(self) -> int:
        return self.spare - len(self._free)

    @staticmethod
    def row_of(req: Request) -> int:
        if req.batch_row is None:
            raise KeyError(f"request {req.request_id} has no batch row")
        return req.batch_row

    def rows_of(self, requests: Sequence[Request]) -> np.ndarray:
        """The requests' batch rows, as one index array."""
        return np.fromiter(map(self.row_of, requests), np.intp, len(requests))

    def release_finished(self) -> None:
        """Take the batch rows back from requests that stopped running."""
        for batch_row, req in enumerate(self._owners):
            if req is not None and req.status is not RequestStatus.RUNNING:
                req.batch_row = self._owners[batch_row] = None
                self._free.append(batch_row)
                self.unset.discard(req)

    def join(self, req: Request) -> None:
        """Give a running request a batch row and write its rows (no-op if it has one). Raises,
        holding nothing, for settings that cannot be built."""
        if req.batch_row is not None:
            return
        batch_row = self._free[-1]
        penalty_row = batch_row if req.params.has_penalties else -1
        built = SamplingTensors.build(
            [
                RowSampling(req.params, req.seed, 0, penalty_row=penalty_row),
                RowSampling(req.params, req.seed, 0, banned_ids=tuple(req.stop_token_ids), penalty_row=penalty_row),
            ],
            2,
            self.spare,
        )
        self._free.pop()
        req.batch_row, self._owners[batch_row] = batch_row, req
        rows = [batch_row, batch_row + self.spare + 1]
        self._settings[rows] = built.settings
        self._bias_ids[rows] = built.bias_ids
        self._bias_values[rows] = built.bias_values
        self._biased[rows] = (built.bias_ids >= 0).any(axis=1)
        if req.params.has_penalties:
            self.unset.add(req)
        self.positions[batch_row] = req.num_tokens - 1
        self.tokens[batch_row] = req.last_token_id
        self.token_src[batch_row] = -1
        self._launch[batch_row] = 0
        self._stops_from[batch_row] = req.num_prompt_tokens + req.params.min_tokens
        ids = sorted(req.stop_token_ids)[:STOP_ID_WIDTH]
        self._stop_ids[batch_row] = -1
        self._stop_ids[batch_row, : len(ids)] = ids
        self.constrained[batch_row] = req.grammar is not None

    def sync_tables(self, batch_rows: np.ndarray, chunks: Sequence[ScheduledChunk]) -> None:
        """Bring the block-table rows of the chunks' batch rows up to their tables: the entries past
        a row's length where the table only grew, the whole row where its version changed."""
        n = len(chunks)
        versions = np.fromiter((c.table_version for c in chunks), np.int64, n)
        lengths = np.fromiter((len(c.block_table) for c in chunks), np.int64, n)
        rewrite = (versions != self._table_versions[batch_rows]) | (versions < 0)
        grown = lengths > self._table_lens[batch_rows]
        for i in np.flatnonzero(rewrite | grown).tolist():
            batch_row, table, length = batch_rows[i], chunks[i].block_table, lengths[i]
            if rewrite[i]:
                self.tables[batch_row, length:] = 0
                self.tables[batch_row, :length] = table
            else:
                start = self._table_lens[batch_row]
                self.tables[batch_row, start:length] = table[start:]
        self._table_versions[batch_rows] = versions
        self._table_lens[batch_rows] = lengths

    def stop_ids(self, batch_rows: np.ndarray) -> np.ndarray:
        """[len(batch_rows), STOP_ID_WIDTH] stop token ids of each batch row's next token: none (-1) while
        its stop tokens are banned (before `min_tokens`)."""
        free = self.positions[batch_rows] + 1 >= self._stops_from[batch_rows]
        return np.where(free[:, None], self._stop_ids[batch_rows], -1)

    def launched(self, launch: int, parts: Sequence[tuple[np.ndarray, int | None]]) -> None:
        """Launch number `launch` (> 0, increasing) is on the device. `parts`: for each of its
        programs, the batch row of each chunk (spare for one that samples nothing), and the row of the
        launch's sampled tokens where its first chunk's token lands (the others' follow), or None
        (verify and multi-step programs, read at once). Each batch row sampled for gains a token that
        only the device knows; the previous launch's sampled tokens are no longer readable."""
        self.token_src[:] = -1
        for batch_rows, first_row in parts:
            sampled = np.flatnonzero(batch_rows != self.spare)
            held = batch_rows[sampled]
            self.positions[held] += 1
            self.tokens[held] = PLACEHOLDER
            self._launch[held] = launch
            if first_row is not None:
                self.token_src[held] = first_row + sampled

    def read(self, launch: int, batch_rows: np.ndarray, tokens: np.ndarray) -> None:
        """The tokens a program of launch `launch` sampled were read: [rows] or [rows, k] (a
        verify or multi-step program; -1 after a row's last token), row i for batch row `batch_rows[i]`.
        A batch row that no later launch sampled for, and that no other request took since, knows its
        last token, and is as many tokens further as the row holds beyond its first."""
        rows = tokens.reshape(tokens.shape[0], -1)[: len(batch_rows)]
        held = np.flatnonzero(self._launch[batch_rows] == launch)
        if not len(held):
            return
        batch_rows, rows = batch_rows[held], rows[held]
        ended = rows < 0
        counts = np.where(ended.any(axis=1), ended.argmax(axis=1), rows.shape[1])
        self.tokens[batch_rows] = rows[np.arange(len(rows)), counts - 1]
        self.token_src[batch_rows] = -1
        self.positions[batch_rows] += counts - 1

    def sampling(
        self, rows: np.ndarray, batch_rows: np.ndarray, ahead: np.ndarray | int, num_rows: int, masked: bool
    ) -> SamplingTensors:
        """Sampling tensors of `num_rows` rows: row `rows[i]` samples the token `ahead[i]` places
        after the next one of the request in batch row `batch_rows[i]` (a verified draft's); the other rows
        are padding. `masked`: some row has a token mask (structured output), so the mask table
        is a host array of allow-all rows for those masks to be written into."""
        index = np.full(num_rows, self.spare, np.intp)
        sampled = self.positions[batch_rows] + 1 + ahead  # the positions of the tokens sampled
        banned = sampled < self._stops_from[batch_rows]  # no stop token yet
        index[rows] = batch_rows + banned * (self.spare + 1)
        if self._biased[index].any():
            bias_ids, bias_values = self._bias_ids[index], self._bias_values[index]
        else:
            bias_ids = self.constant((num_rows, BIAS_WIDTH), np.int32, -1)
            bias_values = self.constant((num_rows, BIAS_WIDTH), np.float32, 0.0)
        shape = (num_rows, self.mask_words)
        token_mask = np.full(shape, -1, np.int32) if masked else self.constant(shape, np.int32, -1)
        t = SamplingTensors(self._settings[index], bias_ids, bias_values, token_mask)
        t.positions[rows] = sampled
        return t
