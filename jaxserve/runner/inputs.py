"""Host side of a step: a SchedulerOutput becomes bucketed numpy arrays (no device work here).

A decode program is keyed by (batch, block-table width), a ragged prefill program by (tokens,
sequences, width): it runs an iteration's prefill chunks and its plain decodes (if any) in one
model step, the decodes counted in its tokens (a vision-language model's carries image rows: `image_inputs.py`);
its logits are padded to a sampler row bucket. A token the previous iteration sampled that the host has not read
(a PLACEHOLDER) is given as its row in that iteration's sampled buffer (`token_src`), never read here.

Decode rows (of decode, multi-step decode and prefill programs) are gathers of the persistent batch's rows
(`InputBatch`) by one index array: tokens, token sources, positions and block tables, and the sampling
settings; prefill chunk rows are built per chunk (each is many tokens). A verify program gathers its
tables and sampling rows, its tokens (the drafts) are per chunk.

What it builds (`Program`, `PreparedStep`) is declared in prepared_step.py. The runner ships a program's
arrays packed into one buffer (`HostPack`; the sampling settings are one array, `SamplingTensors.settings`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jaxserve import faults
from jaxserve.config import bucket_for
from jaxserve.model import AttentionMetadata
from jaxserve.request import PLACEHOLDER, Request
from jaxserve.resolved_config import ResolvedConfig
from jaxserve.runner.image_inputs import EncoderCache, with_image_rows
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.prepared_step import PooledRows, PreparedStep, Program, PromptScores
from jaxserve.runner.prompt_rows import pool_rows, score_rows
from jaxserve.runner.ragged_rows import RaggedRows
from jaxserve.runner.state_rows import state_slot_rows
from jaxserve.runner.verify_inputs import verify_program
from jaxserve.sampling_tensors import SamplingTensors, penalty_history
from jaxserve.scheduler.output import ScheduledChunk, SchedulerOutput
from jaxserve.structured import GrammarState, mask_words

PENALTY_RESET_ROWS = 4  # penalty rows set from histories per call (one compiled shape)


class StepInputs:
    """Builds the arrays of each iteration's programs for one runner."""

    def __init__(
        self,
        engine_config: ResolvedConfig,
        constant: Callable[[tuple[int, ...], np.dtype, object], Any],
        vocab_size: int,
        images: EncoderCache | None = None,  # a vision-language model's: its prefills carry image rows
    ):
        self.config, self.images = engine_config, images
        self.batch = InputBatch(
            engine_config.max_num_seqs, constant, mask_words(vocab_size), max(engine_config.block_table_buckets)
        )
        # Each iteration's sampled tokens, at fixed rows (prefill chunk i at i, decode row j at
        # `decode_offset + j`), stay on the device for the next iteration's placeholders.
        self.decode_offset = self.sampler_rows(max(engine_config.prefill_seq_buckets))
        self.sampled_rows = self.decode_offset + self.sampler_rows(max(engine_config.decode_batch_buckets))
        self.pool_segments = max(engine_config.prefill_seq_buckets)  # chunks of a prefill program, at most
        spec = engine_config.speculative_config
        self.verify_rows = 0 if spec is None else spec.num_speculative_tokens + 1  # rows per verified sequence
        self.verify_batches = engine_config.verify_batch_buckets
        # Drawn drafts (a draft model's, MTP layer's, EAGLE-3 head's) carry q (rejection sampling): per draft token.
        self.verify_vocab = vocab_size if spec is not None and spec.drafts_drawn else 0

    def sampler_rows(self, rows: int) -> int:
        return bucket_for(rows, self.config.sampler_row_buckets)

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """Raises for a request whose inputs cannot be built."""
        ec = self.config
        batch = self.batch
        batch.release_finished()
        sampling = [c.request for c in sched.prefills + sched.decodes if c.sample]
        for req in sampling:
            batch.join(req)
        unset = [req for req in sampling if req in batch.unset]
        resets = [
            self.penalty_reset(unset[i : i + PENALTY_RESET_ROWS]) for i in range(0, len(unset), PENALTY_RESET_ROWS)
        ]
        programs, parts, scores, pooled = [], [], [], []
        decodes = sched.decodes
        batch_rows = self.decode_batch_rows(decodes)
        if sched.prefills:
            chunks = sched.prefills
            # Plain decodes join the prefill chunks in one program; drafts are verified apart.
            joined = not any(c.samples_several for c in decodes)
            programs.append(
                self.prefill(
                    chunks,
                    bucket_for(sum(c.num_new_tokens for c in chunks) + len(decodes) * joined, ec.prefill_token_buckets),
                    bucket_for(len(chunks), ec.prefill_seq_buckets),
                    self._width_bucket(chunks, batch_rows[: len(decodes) * joined]),
                    scores,
                    decodes if joined else [],
                    batch_rows if joined else None,
                    pooled,
                )
            )
            parts.append(chunks + decodes if joined else chunks)
            decodes = [] if joined else decodes
        if decodes:
            chunks = decodes
            size = bucket_for(len(chunks), ec.decode_batch_buckets)
            if any(c.draft for c in chunks):
                programs.append(
                    self.verify(chunks, size, self._width_bucket([], batch_rows, self.verify_rows), batch_rows)
                )
            elif any(c.num_steps > 1 for c in chunks):
                steps = np.fromiter((c.num_steps for c in chunks), np.int32, len(chunks))
                programs.append(self.multi_decode(chunks, size, self._width_bucket([], batch_rows, steps), batch_rows))
            else:
                programs.append(self.decode(chunks, size, self._width_bucket([], batch_rows), batch_rows))
            parts.append(chunks)
        return PreparedStep(resets, unset, programs, parts, scores, pooled)

    def decode_batch_rows(self, chunks: list[ScheduledChunk]) -> np.ndarray:
        """The batch rows of decode chunks (their requests have joined the batch), with their
        block-table rows brought up to date. Raises for a request whose inputs fail."""
        for c in chunks:
            faults.check("input", c.request)
        batch_rows = self.batch.rows_of([c.request for c in chunks])
        self.batch.sync_tables(batch_rows, chunks)
        return batch_rows

    def decode(
        self, chunks: list[ScheduledChunk], batch: int, width: int, batch_rows: np.ndarray | None = None
    ) -> Program:
        """A decode program: one row per chunk, gathered from the chunks' batch rows (`batch_rows`, from
        `decode_batch_rows`; looked up here when None)."""
        batch_rows = self.decode_batch_rows(chunks) if batch_rows is None else batch_rows
        index = self.padded(batch_rows, batch)
        tokens, token_src, positions = self._decode_inputs(index, chunks)
        tables, lora = self.batch.tables[index, :width], self.lora_rows(chunks, batch)
        seq_lens = (positions + 1) * (index != self.batch.spare)  # padding rows: 0
        states = state_slot_rows(chunks, [], batch, batch, self.config.num_state_slots > 0)
        slots = self._kv_slots(tables, positions)
        meta = AttentionMetadata(slots, tables, seq_lens, lora_slots=lora, state_slots=states)
        host_args = (tokens, positions, meta, np.arange(batch, dtype=np.int32), token_src)
        sampling, masks = self._sampling(chunks, batch_rows, self.sampler_rows(batch))
        return Program(
            ("decode", batch, width),
            host_args,
            sampling,
            self.decode_offset,
            batch_rows,
            masks=masks,
            constrained=bool(masks),
        )

    def multi_decode(
        self, chunks: list[ScheduledChunk], batch: int, width: int, batch_rows: np.ndarray | None = None
    ) -> Program:
        """A multi-step decode program: `num_scheduler_steps` decode steps of the batch in one
        device loop, each feeding its sampled tokens to the next. Row i takes at most
        `num_steps[i]` steps (its KV slots are allocated) and stops after one of its `stop_ids`
        (STOP_ID_WIDTH of them; a stop token beyond those, or a stop string, is caught on the host,
        which drops what follows). Its sampling row is the same at every step but for the
        position, so a row whose `min_tokens` ends inside the loop takes steps only up to there
        (`jaxserve.scheduler.multi_step.MultiStepDecode.loop_steps`)."""
        batch_rows = self.decode_batch_rows(chunks) if batch_rows is None else batch_rows
        index = self.padded(batch_rows, batch)
        tokens, token_src, positions = self._decode_inputs(index, chunks)
        num_steps = np.zeros(batch, np.int32)
        num_steps[: len(chunks)] = [c.num_steps for c in chunks]
        states = state_slot_rows(chunks, [], batch, batch, self.config.num_state_slots > 0)  # a hybrid's; else None
        tables, stop_ids = self.batch.tables[index, :width], self.batch.stop_ids(index)
        host_args = (tokens, positions, tables, num_steps, stop_ids, token_src, states)
        sampling, masks = self._sampling(chunks, batch_rows, self.sampler_rows(batch))
        return Program(
            ("multi_decode", batch, width),
            host_args,
            sampling,
            self.decode_offset,
            batch_rows,
            masks=masks,
            constrained=bool(masks),
            num_steps=self.config.num_scheduler_steps,
        )

    def verify(
        self, chunks: list[ScheduledChunk], batch: int, width: int, batch_rows: np.ndarray | None = None
    ) -> Program:
        """A verify program (speculative decoding; `verify_program`)."""
        return verify_program(self, chunks, batch, width, batch_rows)

    def decode_rows(self, num_tokens: int) -> int:
        """Decode sequences of a prefill program of `num_tokens` rows: every decode an iteration
        of that many tokens can hold (each takes one of them, and at most max_num_seqs run)."""
        return min(num_tokens, self.config.max_num_seqs)

    def prefill(
        self,
        chunks: list[ScheduledChunk],
        num_tokens: int,
        num_seqs: int,
        width: int,
        scores: list[PromptScores] | None = None,
        decodes: list[ScheduledChunk] = (),
        decode_batch_rows: np.ndarray | None = None,
        pooled: list[PooledRows] | None = None,
    ) -> Program:
        """A ragged prefill program: the chunks' rows, then one row per decode of `decodes`, in
        one model step (one read of the weights), with `decode_rows` decode sequences after the
        `num_seqs` chunk ones (`AttentionMetadata.decode_rows`; padding ones have length 0, so
        an iteration without decodes costs their attention almost nothing). Its sampling rows
        are the chunks' then the decodes', in order. Rows that score prompt positions are listed
        in `scores`, and rows that embeddings pool in `pooled`. The decodes' rows are gathered
        from their batch rows (`decode_batch_rows`, as `decode_batch_rows()` gives them; looked up here when None)."""
        num_decodes = self.decode_rows(num_tokens)
        decodes = list(decodes)
        decode_batch_rows = self.decode_batch_rows(decodes) if decode_batch_rows is None else decode_batch_rows
        # It samples for its chunks and decodes, at most max_num_seqs; padding rows are -1 (the C++ head
        # skips them: a 512-row step's 64 rows cost ~19 ms in the default model's bf16 head, not 1 row's).
        num_logits = min(num_seqs + num_decodes, self.config.max_num_seqs)
        r = RaggedRows.empty(num_tokens, num_seqs, num_decodes, width, num_logits)
        chunk_batch_rows = self._chunk_rows(chunks, r)
        decode_rows = self._joined_decode_rows(decodes, decode_batch_rows, r, len(chunks), num_seqs)
        lora = self.lora_rows(chunks + decodes, num_tokens, [c.num_new_tokens for c in chunks] + [1] * len(decodes))
        states = state_slot_rows(chunks, decodes, num_seqs, num_seqs + num_decodes, self.config.num_state_slots > 0)
        meta = AttentionMetadata(r.kv_slots, r.tables, r.seq_lens, r.query_start, decode_rows, lora, state_slots=states)
        host_args = with_image_rows((r.tokens, r.positions, meta, r.logits_indices, r.token_src), chunks, self.images)
        batch_rows = np.concatenate([chunk_batch_rows, decode_batch_rows])
        sampling, masks = self._sampling(chunks + decodes, batch_rows, self.sampler_rows(num_logits))
        return Program(
            ("prefill", num_tokens, num_seqs, width),
            host_args,
            sampling,
            0,
            batch_rows,
            score_rows(chunks, num_tokens, scores),
            masks=masks,
            constrained=bool(masks),
            pool=pool_rows(chunks, num_tokens, pooled, self.pool_segments),
        )

    def _chunk_rows(self, chunks: list[ScheduledChunk], r: RaggedRows) -> np.ndarray:
        """Fill the prompt chunks' rows and sequences (chunk i is sequence i, its rows after chunk
        i - 1's); return each chunk's row in the persistent batch (the spare one: it samples nothing)."""
        bs, width = self.config.block_size, r.tables.shape[1]
        chunk_batch_rows = np.full(len(chunks), self.batch.spare, np.intp)
        row = 0
        for i, c in enumerate(chunks):
            faults.check("input", c.request)
            n = c.num_new_tokens
            table = c.block_table[:width]
            r.tables[i, : len(table)] = table
            pos = np.arange(c.start, c.start + n)
            r.tokens[row : row + n] = c.token_ids
            if c.sample:
                chunk_batch_rows[i] = self.batch.row_of(c.request)
                r.token_src[row + n - 1] = self._pending_input(c, chunk_batch_rows[i])
            r.positions[row : row + n] = pos
            r.kv_slots[row : row + n] = r.tables[i, pos // bs] * bs + pos % bs
            r.seq_lens[i] = c.start + n
            row += n
            r.query_start[i + 1] = row
            r.logits_indices[i] = row - 1
        r.query_start[len(chunks) + 1 :] = row
        return chunk_batch_rows

    def _joined_decode_rows(
        self,
        decodes: list[ScheduledChunk],
        decode_batch_rows: np.ndarray,
        r: RaggedRows,
        num_chunks: int,
        num_seqs: int,
    ) -> np.ndarray:
        """Fill the rows of the decodes that join a prefill program: one each after the chunks' rows,
        sequences `num_seqs`.. of the tables, gathered from their batch rows; return each decode sequence's
        row (`AttentionMetadata.decode_rows`; the program's token count for padding ones)."""
        num_tokens, num_decodes = len(r.tokens), len(r.seq_lens) - num_seqs
        first = int(r.query_start[-1])
        rows = np.arange(first, first + len(decodes))
        index = self.padded(decode_batch_rows, num_decodes)
        r.tokens[rows], r.token_src[rows], decode_positions = self._decode_inputs(index[: len(decodes)], decodes)
        r.positions[rows] = decode_positions
        r.tables[num_seqs:] = self.batch.tables[index, : r.tables.shape[1]]
        r.kv_slots[rows] = self._kv_slots(r.tables[num_seqs : num_seqs + len(decodes)], decode_positions)
        r.seq_lens[num_seqs : num_seqs + len(decodes)] = decode_positions + 1
        decode_rows = np.full(num_decodes, num_tokens, np.int32)
        decode_rows[: len(decodes)] = r.logits_indices[num_chunks : num_chunks + len(decodes)] = rows
        return decode_rows

    def lora_rows(
        self, chunks: list[ScheduledChunk], num_rows: int, rows_per_chunk: list[int] | None = None
    ) -> np.ndarray | None:
        """With LoRA on, each row's LoRA slot (`Request.lora_slot`; -1 for the base model and
        for padding): chunk i has `rows_per_chunk[i]` consecutive rows (one each by default)."""
        if not self.config.enable_lora:
            return None
        counts = [1] * len(chunks) if rows_per_chunk is None else rows_per_chunk
        out = np.full(num_rows, -1, np.int32)
        filled = np.repeat(np.fromiter((c.request.lora_slot for c in chunks), np.int32, len(chunks)), counts)
        out[: len(filled)] = filled
        return out

    def penalty_reset(self, requests: list[Request]) -> tuple[np.ndarray, ...]:
        """Arguments of a penalty-row reset for up to PENALTY_RESET_ROWS requests' batch rows: batch_rows,
        histories so far, which of their tokens are generated, and for a history whose last token
        is still in flight, its row in the previous iteration's sampled tokens and its index."""
        length, rows = self.config.max_model_len, PENALTY_RESET_ROWS
        batch_rows, token_src, token_index = (
            np.full(rows, -1, np.int32),
            np.full(rows, -1, np.int32),
            np.zeros(rows, np.int32),
        )
        history = np.full((rows, length), -1, np.int32)
        is_output = np.zeros((rows, length), np.bool_)
        for i, req in enumerate(requests):
            batch_rows[i] = self.batch.row_of(req)
            history[i], is_output[i] = penalty_history(req.prompt_token_ids, req.output_token_ids, req.params, length)
            if req.output_token_ids[-1:] == [PLACEHOLDER]:
                token_src[i] = self._in_flight(req, batch_rows[i])
                token_index[i] = int(np.flatnonzero(is_output[i])[-1])
        return batch_rows, history, is_output, token_src, token_index

    def _width_bucket(self, chunks: list[ScheduledChunk], batch_rows: np.ndarray, rows: np.ndarray | int = 1) -> int:
        """Block-table width of a step of prefill chunks and decodes (their batch rows; `rows`:
        positions each decode takes from its next one, per decode or for all)."""
        bs = self.config.block_size
        need = max((-(-(c.start + c.num_new_tokens) // bs) for c in chunks), default=1)
        if len(batch_rows):
            need = max(need, int(np.max(-(-(self.batch.positions[batch_rows] + rows) // bs))))
        return bucket_for(need, self.config.block_table_buckets)

    def padded(self, batch_rows: np.ndarray, rows: int) -> np.ndarray:
        """`batch_rows` then the spare row, `rows` in all: the index of a program's gathers."""
        index = np.full(rows, self.batch.spare, np.intp)
        index[: len(batch_rows)] = batch_rows
        return index

    def _decode_inputs(self, index: np.ndarray, chunks: list[ScheduledChunk]) -> tuple[np.ndarray, ...]:
        """Tokens, token sources and positions of decode rows, gathered from batch rows `index`
        (the chunks' first). Raises for a request whose token is neither known nor in flight."""
        batch = self.batch
        tokens, token_src = batch.tokens[index], batch.token_src[index]
        lost = np.flatnonzero((tokens < 0) & (token_src < 0))
        if len(lost):
            raise ValueError(
                f"request {chunks[lost[0]].request.request_id!r} decodes a token that is "
                "neither read nor in the previous iteration's sampled tokens"
            )
        return tokens, token_src, batch.positions[index]

    def _kv_slots(self, tables: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The KV slot each row's token is written to: row i at `positions[i]` in table row i."""
        bs = self.config.block_size
        return tables[np.arange(len(positions)), positions // bs] * bs + positions % bs

    def _sampling(
        self, chunks: list[ScheduledChunk], batch_rows: np.ndarray, rows: int
    ) -> tuple[SamplingTensors, tuple[tuple[int, GrammarState], ...]]:
        """The sampling tensors of chunks with these batch rows (the spare one: a chunk that samples
        nothing), one row each (gathered from the persistent batch), and their constrained rows
        (`Program.masks`)."""
        masks = self.constrained_rows(chunks, batch_rows, 1)
        self.check_sampling(chunks)
        sampled = np.flatnonzero(batch_rows != self.batch.spare)
        return self.batch.sampling(sampled, batch_rows[sampled], 0, rows, bool(masks)), masks

    @staticmethod
    def check_sampling(chunks: list[ScheduledChunk]) -> None:
        for c in chunks:
            if c.sample:
                faults.check("sampling", c.request)

    def constrained_rows(
        self, chunks: list[ScheduledChunk], batch_rows: np.ndarray, rows_per_chunk: int
    ) -> tuple[tuple[int, GrammarState], ...]:
        return tuple(
            (i * rows_per_chunk, chunks[i].request.grammar)
            for i in np.flatnonzero(self.batch.constrained[batch_rows]).tolist()
        )

    def _pending_input(self, chunk: ScheduledChunk, batch_row: int) -> int:
        """Row of the previous iteration's sampled buffer holding a sampling chunk's last input
        token, when that token is still a PLACEHOLDER (the step that samples it has not been read)."""
        out = chunk.request.output_token_ids
        return self._in_flight(chunk.request, batch_row) if out and out[-1] == PLACEHOLDER else -1

    def _in_flight(self, req: Request, batch_row: int) -> int:
        """Row of the previous iteration's sampled buffer holding the request's last token,
        which the host does not know yet."""
        row = int(self.batch.token_src[batch_row])
        if row < 0:
            raise ValueError(
                f"request {req.request_id!r}: its last token is neither read nor in the "
                "previous iteration's sampled tokens"
            )
        return row
