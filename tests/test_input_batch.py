"""The persistent batch: a step's sampling tensors gathered from batch rows equal the ones built
from each row's settings, whatever joined, left or changed state between steps; block-table rows
follow the KV manager's tables incrementally (growth, a block swapped for the cache's copy, swap,
released batch rows, a batch row given to another request); positions and tokens follow launches and reads;
and the arrays of every program an engine runs (through the real scheduler and KV manager, the tiny
model) equal the ones rebuilt from its scheduled chunks row by row."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from config_harness import resolved

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM
from jaxserve.kv import KVHandle, build_kv_manager
from jaxserve.model import AttentionMetadata
from jaxserve.request import PLACEHOLDER, Request, RequestStatus
from jaxserve.runner.input_batch import STOP_ID_WIDTH, InputBatch
from jaxserve.runner.inputs import StepInputs
from jaxserve.runner.prepared_step import Program
from jaxserve.sampling_params import SamplingParams
from jaxserve.sampling_tensors import BIAS_WIDTH, RowSampling, SamplingTensors
from jaxserve.scheduler.output import ScheduledChunk
from jaxserve.structured import GuidedDecoding

BATCH_ROWS = 4
WIDTH = 8  # block-table row width of the unit tests' batches


def filled(shape, dtype, fill):
    return np.full(shape, fill, dtype)


def running(rid: str, params: SamplingParams, seed: int, outputs: int = 0, prompt: list[int] | None = None) -> Request:
    req = Request(rid, prompt or [5, 6, 7], params, seed=seed, eos_token_ids=(2,))
    req.status = RequestStatus.RUNNING
    req.output_token_ids = list(range(10, 10 + outputs))
    return req


def built(batch: InputBatch, rows: list[tuple[int, Request, int]], num_rows: int, masked: bool) -> SamplingTensors:
    """What SamplingTensors.build makes of the same rows (the reference)."""
    settings = [None] * num_rows
    for row, req, ahead in rows:
        banned = len(req.output_token_ids) + ahead < req.params.min_tokens
        settings[row] = RowSampling(
            req.params,
            req.seed,
            req.num_tokens + ahead,
            banned_ids=tuple(req.stop_token_ids) if banned else (),
            penalty_row=batch.row_of(req) if req.params.has_penalties else -1,
            token_mask=np.full(batch.mask_words, -1, np.int32) if masked else None,
        )
    return SamplingTensors.build(settings, num_rows, batch.spare, mask_words=batch.mask_words)


def gathered(batch: InputBatch, rows: list[tuple[int, Request, int]], num_rows: int, masked: bool) -> SamplingTensors:
    """The batch's sampling tensors of the same rows (its one index array per argument)."""
    index, requests, ahead = zip(*rows) if rows else ((), (), ())
    return batch.sampling(np.array(index, np.intp), batch.rows_of(requests), np.array(ahead, np.intp), num_rows, masked)


def assert_same(a: SamplingTensors, b: SamplingTensors) -> None:
    for name in a.__dataclass_fields__:
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, logprobs=2),
    SamplingParams(temperature=1.0, min_tokens=3, frequency_penalty=0.5, logit_bias={4: 1.5}),
    SamplingParams(temperature=0.5, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.2),
]


def test_gathered_rows_equal_built_rows_as_requests_join_leave_and_pass_min_tokens():
    batch = InputBatch(BATCH_ROWS, filled, mask_words=3, max_blocks=WIDTH)
    reqs = [running(f"r{i}", p, seed=100 + i, outputs=i) for i, p in enumerate(MIXED)]
    for step in range(5):
        for req in reqs:
            batch.join(req)
        rows = [(j, req, 0) for j, req in enumerate(reversed(reqs))]  # any order, not batch_row order
        for masked in (False, True):
            assert_same(gathered(batch, rows, 6, masked), built(batch, rows, 6, masked))
        for req in reqs:
            req.output_token_ids.append(1)  # r2 passes its min_tokens at the second step
        batch.launched(step + 1, [(batch.rows_of(reqs), 0)])  # the step that sampled those
        if step == 2:  # one leaves, a new one takes its batch row
            reqs[1].status = RequestStatus.FINISHED
            batch.release_finished()
            reqs[1] = running("late", SamplingParams(temperature=0.3, logit_bias={9: -2.0}, min_tokens=9), seed=5)
    assert len(batch) == BATCH_ROWS


def test_draft_rows_sample_positions_ahead_with_their_own_stop_token_ban():
    batch = InputBatch(BATCH_ROWS, filled, mask_words=0, max_blocks=WIDTH)
    req = running("v", SamplingParams(temperature=0.0, min_tokens=3), seed=0, outputs=1)
    batch.join(req)
    rows = [(j, req, j) for j in range(4)]  # banned at 0 and 1 drafts ahead, free from 2
    t = gathered(batch, rows, 4, masked=False)
    assert_same(t, built(batch, rows, 4, False))
    assert list(t.positions) == [4, 5, 6, 7]
    assert [bool((t.bias_ids[j] == 2).any()) for j in range(4)] == [True, True, False, False]


def test_batch_rows_are_reused_and_penalty_rows_start_unset():
    batch = InputBatch(2, filled, mask_words=0, max_blocks=WIDTH)
    a = running("a", SamplingParams(presence_penalty=1.0), 0)
    b = running("b", SamplingParams(), 1)
    batch.join(a), batch.join(b), batch.join(a)
    assert {batch.row_of(a), batch.row_of(b)} == {0, 1} and batch.unset == {a}
    before = gathered(batch, [(0, a, 0)], 2, masked=False)
    a.status = RequestStatus.PREEMPTED  # leaves; comes back with a fresh batch row and an unset row
    batch.release_finished()
    assert batch.unset == set() and len(batch) == 1
    c = running("c", SamplingParams(temperature=0.9, seed=3), 3)
    batch.join(c)
    assert batch.row_of(c) == 0
    assert before.presence_penalty[0] == 1.0 and before.penalty_rows[0] == 0  # arrays handed out stay
    with pytest.raises(KeyError):
        batch.rows_of([a])


def test_tables_no_row_uses_come_from_the_constant_arrays():
    made = []

    def constant(shape, dtype, fill):
        made.append(shape)
        return np.full(shape, fill, dtype)

    batch = InputBatch(BATCH_ROWS, constant, mask_words=2, max_blocks=WIDTH)
    plain = running("p", SamplingParams(temperature=0.0), 0)
    biased = running("b", SamplingParams(logit_bias={3: 2.0}), 1)
    batch.join(plain), batch.join(biased)
    made.clear()
    t = gathered(batch, [(1, plain, 0)], 3, masked=False)
    assert made == [(3, BIAS_WIDTH), (3, BIAS_WIDTH), (3, 2)]
    assert list(t.penalty_rows) == [BATCH_ROWS] * 3 and list(t.temperature) == [0.0] * 3
    made.clear()
    t = gathered(batch, [(0, plain, 0), (2, biased, 0)], 3, masked=True)
    assert made == []  # a biased row and a masked batch: host tables to write into
    assert t.bias_ids[2, 0] == 3 and (t.bias_ids[:2] == -1).all() and (t.token_mask == -1).all()


# ----- block-table rows against the KV manager's tables ----------------------------------------

BS = 4
POISON = 999  # written into a row to see whether the next sync rewrites it


class Tables:
    """A KV manager and a batch whose table rows follow its tables, as a step's decodes sync them."""

    def __init__(self, **kv):
        self.kv = build_kv_manager(64, BS, watermark_blocks=0, **kv)
        self.batch = InputBatch(BATCH_ROWS, filled, mask_words=0, max_blocks=WIDTH)
        self.reqs: dict[str, Request] = {}

    def admit(self, rid: str, ids: list[int]) -> Request:
        req = self.reqs[rid] = running(rid, SamplingParams(), 0, prompt=ids)
        req.kv = self.kv.admit(self.kv.match_prefix(ids), len(ids))
        assert req.kv is not None
        self.batch.join(req)
        return req

    def handle(self, rid: str) -> KVHandle:
        return self.reqs[rid].kv

    def sync(self, *rids: str) -> None:
        chunks = [
            ScheduledChunk(self.reqs[r], 0, 1, self.handle(r).block_table, True, table_version=self.handle(r).version)
            for r in rids
        ]
        self.batch.sync_tables(self.batch.rows_of([c.request for c in chunks]), chunks)

    def row(self, rid: str) -> list[int]:
        return self.batch.tables[self.batch.row_of(self.reqs[rid])].tolist()

    def expected(self, rid: str) -> list[int]:
        table = self.handle(rid).block_table.tolist()
        return table + [0] * (WIDTH - len(table))

    def poison(self, rid: str, entry: int) -> None:
        self.batch.tables[self.batch.row_of(self.reqs[rid]), entry] = POISON


def test_a_table_row_gains_only_its_new_entries():
    t = Tables()
    t.admit("a", list(range(6)))  # [0 1 2 3] [4 5 . .]
    t.sync("a")
    assert t.row("a") == t.expected("a") and t.row("a")[2:] == [0] * (WIDTH - 2)
    t.poison("a", 0)
    assert t.kv.allocate_kv_slots(t.handle("a"), 2)  # fills block 1: nothing new
    t.sync("a")
    assert t.row("a")[0] == POISON
    assert t.kv.allocate_kv_slots(t.handle("a"), 2)  # a third block
    t.sync("a")
    assert t.row("a")[0] == POISON and t.row("a")[1:] == t.expected("a")[1:]  # only the new entry was written


def test_a_table_row_is_rewritten_after_swap_in_and_after_released_blocks_come_back():
    t = Tables(num_host_slots=16)
    t.admit("a", list(range(9)))
    t.sync("a")
    t.poison("a", 0)
    assert t.kv.swap_out(t.handle("a")) and t.kv.swap_in(t.handle("a"))
    t.sync("a")
    assert t.row("a") == t.expected("a")
    t.poison("a", 2)
    assert t.kv.allocate_kv_slots(t.handle("a"), 4)  # a fourth block, released (rejected drafts), then another
    t.kv.release_kv_slots(t.handle("a"), 9)
    assert t.kv.allocate_kv_slots(t.handle("a"), 4)
    t.sync("a")  # the same length as the last sync, other entries
    assert t.row("a") == t.expected("a")


def test_a_table_row_is_rewritten_when_a_block_is_swapped_for_the_caches_copy():
    t = Tables()
    ids = list(range(9))
    t.admit("a", ids), t.admit("b", ids)  # the same tokens, computed twice
    t.sync("a", "b")
    t.kv.cache_full_blocks(t.handle("a"), ids)
    t.kv.cache_full_blocks(t.handle("b"), ids)  # b switches to a's cached blocks
    t.sync("b")
    assert t.row("b")[:2] == t.row("a")[:2] and t.row("b") == t.expected("b")


def test_a_batch_row_given_to_another_request_gets_its_whole_row():
    t = Tables()
    a = t.admit("a", list(range(20)))
    t.sync("a")
    batch_row = t.batch.row_of(a)
    a.status = RequestStatus.FINISHED
    t.kv.free(a.kv)
    t.batch.release_finished()
    t.admit("b", list(range(50, 55)))  # shorter, in the same batch row
    assert t.batch.row_of(t.reqs["b"]) == batch_row
    t.sync("b")
    assert t.row("b") == t.expected("b") and t.row("b")[2:] == [0] * (WIDTH - 2)


def test_a_chunk_without_a_table_version_always_copies_its_table():
    t = Tables()
    req = t.admit("a", list(range(5)))
    batch_row = np.array([t.batch.row_of(req)])
    for table in ([7, 8], [9, 10]):  # hand-built chunks of the same length
        t.batch.sync_tables(batch_row, [ScheduledChunk(req, 4, 1, np.array(table, np.int32), True)])
        assert t.row("a") == table + [0] * (WIDTH - 2)


# ----- positions and tokens -------------------------------------------------------------------


def test_positions_and_tokens_follow_launches_and_reads():
    batch = InputBatch(BATCH_ROWS, filled, mask_words=0, max_blocks=WIDTH)
    a = running("a", SamplingParams(), 0, outputs=2)  # 5 tokens: the last, 11, at position 4
    b = running("b", SamplingParams(), 0)  # the prompt's last, 7, at position 2
    batch.join(a), batch.join(b)
    batch_rows = batch.rows_of([a, b])

    def state() -> tuple[list[int], ...]:
        return (
            batch.positions[batch_rows].tolist(),
            batch.tokens[batch_rows].tolist(),
            batch.token_src[batch_rows].tolist(),
        )

    assert state() == ([4, 2], [11, 7], [-1, -1])
    batch.launched(1, [(batch_rows, 5)])  # both sampled: rows 5 and 6 of launch 1's tokens
    assert state() == ([5, 3], [PLACEHOLDER] * 2, [5, 6])
    batch.launched(2, [(np.array([batch_rows[0], batch.spare]), None)])  # a alone, in a multi-step loop
    assert state() == ([6, 3], [PLACEHOLDER] * 2, [-1, -1])  # launch 1's tokens are gone
    batch.read(1, batch_rows, np.array([20, 21, 0, 0]))  # launch 1 read after launch 2
    assert state() == ([6, 3], [PLACEHOLDER, 21], [-1, -1])  # a's last token is launch 2's
    batch.read(2, np.array([batch_rows[0], batch.spare]), np.array([[30, 31, 32, -1], [-1] * 4]))
    assert state() == ([8, 3], [32, 21], [-1, -1])  # two tokens beyond the first
    batch.launched(3, [(batch_rows[::-1], 0)])
    assert state() == ([9, 4], [PLACEHOLDER] * 2, [1, 0])
    b.status = RequestStatus.FINISHED  # b leaves before launch 3 is read; c takes its batch row
    batch.release_finished()
    c = running("c", SamplingParams(), 0, outputs=1)
    batch.join(c)
    assert batch.row_of(c) == batch_rows[1]
    batch.read(3, batch_rows[::-1], np.array([40, 41]))
    assert state() == ([9, 3], [41, 10], [-1, -1])  # c's row is its own


def test_multi_step_stop_ids_start_with_min_tokens():
    batch = InputBatch(BATCH_ROWS, filled, mask_words=0, max_blocks=WIDTH)
    stops = list(range(40, 40 + STOP_ID_WIDTH + 2))
    req = running("s", SamplingParams(min_tokens=2, stop_token_ids=stops), 0, outputs=1)
    batch.join(req)
    batch_row = np.array([batch.row_of(req)])
    assert (batch.stop_ids(batch_row) == -1).all()  # its next token is its second: stops banned
    batch.launched(1, [(batch_row, None)])
    assert batch.stop_ids(batch_row).tolist() == [sorted([2, *stops])[:STOP_ID_WIDTH]]


def test_a_decode_whose_token_is_neither_read_nor_in_flight_raises():
    inputs = StepInputs(
        resolved(
            max_num_seqs=4,
            max_model_len=64,
            block_size=8,
            decode_batch_buckets=(4,),
            block_table_buckets=(8,),
            sampler_row_buckets=(4,),
        ),
        filled,
        64,
    )
    req = running("lost", SamplingParams(), 0, outputs=1)
    req.output_token_ids.append(PLACEHOLDER)  # in flight, but not in any launch the batch knows
    inputs.batch.join(req)
    chunk = ScheduledChunk(req, req.num_tokens - 1, 1, np.array([1], np.int32), True)
    with pytest.raises(ValueError, match="lost"):
        inputs.decode([chunk], 4, 8)


# ----- every program of an engine against the arrays rebuilt from its chunks ------------------


def rebuilt_tables(chunks: list[ScheduledChunk], rows: int, width: int) -> np.ndarray:
    tables = np.zeros((rows, width), np.int32)
    for i, c in enumerate(chunks):
        n = min(len(c.block_table), width)
        tables[i, :n] = c.block_table[:n]
    return tables


def pending(c: ScheduledChunk, prev_rows: dict[Request, int]) -> int:
    out = c.request.output_token_ids
    return prev_rows[c.request] if c.sample and out and out[-1] == PLACEHOLDER else -1


def rebuilt_decode(chunks, batch, width, prev_rows, bs) -> tuple:
    tokens, token_src = np.zeros(batch, np.int32), np.full(batch, -1, np.int32)
    positions, kv_slots, seq_lens = (np.zeros(batch, np.int32) for _ in range(3))
    tables = rebuilt_tables(chunks, batch, width)
    for i, c in enumerate(chunks):
        tokens[i], token_src[i], positions[i] = c.request.last_token_id, pending(c, prev_rows), c.start
        kv_slots[i] = tables[i, c.start // bs] * bs + c.start % bs
        seq_lens[i] = c.start + 1
    return tokens, positions, AttentionMetadata(kv_slots, tables, seq_lens), np.arange(batch, dtype=np.int32), token_src


def rebuilt_multi_decode(chunks, batch, width, prev_rows) -> tuple:
    tokens, token_src = np.zeros(batch, np.int32), np.full(batch, -1, np.int32)
    positions, num_steps = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
    stop_ids = np.full((batch, STOP_ID_WIDTH), -1, np.int32)
    for i, c in enumerate(chunks):
        req = c.request
        tokens[i], token_src[i], positions[i] = req.last_token_id, pending(c, prev_rows), c.start
        num_steps[i] = c.num_steps
        if len(req.output_token_ids) >= req.params.min_tokens:
            ids = sorted(req.stop_token_ids)[:STOP_ID_WIDTH]
            stop_ids[i, : len(ids)] = ids
    return tokens, positions, rebuilt_tables(chunks, batch, width), num_steps, stop_ids, token_src


def rebuilt_prefill(inputs: StepInputs, chunks, decodes, num_tokens, num_seqs, width, prev_rows) -> tuple:
    bs, num_decodes = inputs.config.block_size, inputs.decode_rows(num_tokens)
    tokens, token_src = np.zeros(num_tokens, np.int32), np.full(num_tokens, -1, np.int32)
    positions, kv_slots = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    seq_lens, query_start = np.zeros(num_seqs + num_decodes, np.int32), np.zeros(num_seqs + 1, np.int32)
    logits_indices = np.full(min(num_seqs + num_decodes, inputs.config.max_num_seqs), -1, np.int32)
    tables = np.concatenate([rebuilt_tables(chunks, num_seqs, width), rebuilt_tables(decodes, num_decodes, width)])
    decode_rows = np.full(num_decodes, num_tokens, np.int32)
    row = 0
    for i, c in enumerate(chunks):
        n = c.num_new_tokens
        pos = np.arange(c.start, c.start + n)
        tokens[row : row + n], positions[row : row + n] = c.token_ids, pos
        token_src[row + n - 1] = pending(c, prev_rows)
        kv_slots[row : row + n] = tables[i, pos // bs] * bs + pos % bs
        seq_lens[i], query_start[i + 1], logits_indices[i] = c.start + n, row + n, row + n - 1
        row += n
    query_start[len(chunks) + 1 :] = row
    for j, c in enumerate(decodes):
        tokens[row], token_src[row], positions[row] = c.request.last_token_id, pending(c, prev_rows), c.start
        kv_slots[row] = tables[num_seqs + j, c.start // bs] * bs + c.start % bs
        seq_lens[num_seqs + j] = c.start + 1
        decode_rows[j] = logits_indices[len(chunks) + j] = row
        row += 1
    meta = AttentionMetadata(kv_slots, tables, seq_lens, query_start, decode_rows)
    return tokens, positions, meta, logits_indices, token_src


def sampled_rows(program: Program, chunks: list[ScheduledChunk], verify_rows: int) -> list[tuple[int, Request, int]]:
    if program.key[0] != "verify":
        return [(i, c.request, 0) for i, c in enumerate(chunks) if c.sample]
    return [
        (i * verify_rows + j, c.request, j) for i, c in enumerate(chunks) if c.sample for j in range(1 + len(c.draft))
    ]


class Checks:
    """Wraps an engine's runner: each prepared program's arrays must equal the ones rebuilt from
    its chunks, with the previous launch's sampled rows (what the runner kept per request). The
    mismatches are kept in `errors` (the engine would fail the requests of a step whose inputs
    raise, and go on)."""

    def __init__(self, llm: LLM):
        self.runner = runner = llm.engine.runner
        self.prev_rows: dict[Request, int] = {}
        self.kinds: dict[str, int] = {}
        self.versions: dict[Request, set[int]] = {}
        self.errors: list[AssertionError] = []
        prepare, launch = runner.prepare, runner.run_model

        def checked_prepare(sched):
            prepared = prepare(sched)
            for program, chunks in zip(prepared.programs, prepared.parts):
                try:
                    self.check(program, chunks, len(sched.prefills) if program.key[0] == "prefill" else 0)
                except AssertionError as e:
                    self.errors.append(e)
            return prepared

        def recording_launch(sched, prepared, **kwargs):
            self.prev_rows = {
                c.request: p.sample_offset + i
                for chunks, p in zip(prepared.parts, prepared.programs)
                if p.drafts is None and p.num_steps == 1
                for i, c in enumerate(chunks)
                if c.sample
            }
            return launch(sched, prepared, **kwargs)

        runner.prepare, runner.run_model = checked_prepare, recording_launch

    def check(self, program: Program, chunks: list[ScheduledChunk], num_prefills: int) -> None:
        inputs = self.runner.inputs
        kind, *shape = program.key
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        for c in chunks[num_prefills:]:
            self.versions.setdefault(c.request, set()).add(c.table_version)
        if kind == "decode":
            expected = rebuilt_decode(chunks, *shape, self.prev_rows, inputs.config.block_size)
        elif kind == "multi_decode":
            expected = rebuilt_multi_decode(chunks, *shape, self.prev_rows)
        elif kind == "prefill":
            expected = rebuilt_prefill(inputs, chunks[:num_prefills], chunks[num_prefills:], *shape, self.prev_rows)
        else:  # verify: its tables are gathered, the rest is built per chunk
            batch, width = shape
            np.testing.assert_array_equal(program.host_args[2].block_tables, rebuilt_tables(chunks, batch, width))
            expected = None
        if expected is not None:
            got, want = jax.tree_util.tree_leaves(program.host_args), jax.tree_util.tree_leaves(expected)
            assert len(got) == len(want)
            for i, (g, w) in enumerate(zip(got, want)):
                assert g.dtype == w.dtype and g.shape == w.shape, (kind, i, g.dtype, w.dtype, g.shape, w.shape)
                np.testing.assert_array_equal(g, w, err_msg=f"{kind} argument {i}")
        rows = sampled_rows(program, chunks, inputs.verify_rows)
        num_rows = program.sampling.temperature.shape[0]
        assert_same(program.sampling, built(inputs.batch, rows, num_rows, bool(program.masks)))


ASYNC_SMALL = dict(
    max_num_seqs=16,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=8,
    decode_batch_buckets=(4, 16),
    block_table_buckets=(32,),
    sampler_row_buckets=(16,),
    prefill_token_buckets=(32, 64),
    prefill_seq_buckets=(1, 4),
)
STEPS_SMALL = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=200,
    decode_batch_buckets=(2, 8),
    block_table_buckets=(16,),
    sampler_row_buckets=(8,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
)
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 4,
    "adaptive_draft_length": False,
}
CASES = {
    "async-recompute": dict(ASYNC_SMALL, async_scheduling=True, num_blocks=40),
    "sync-swap": dict(
        ASYNC_SMALL, async_scheduling=False, num_blocks=40, preemption_mode="swap", swap_space_blocks=200
    ),
    "async-multi-step": dict(STEPS_SMALL, async_scheduling=True, num_scheduler_steps=4),
    "async-speculative": dict(STEPS_SMALL, async_scheduling=True, speculative_config=SPEC),
}


def workload(rng: np.random.Generator, n: int, max_len: int, guided: bool) -> list[tuple[list[int], SamplingParams]]:
    """Prompts with shared prefixes, repeats (speculation's drafts) and twins (the same greedy
    tokens: the later twin's blocks are swapped for the cache's copies while it decodes), and
    mixed sampling settings."""
    shared = rng.integers(3, 250, 16).tolist()
    kinds = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.8, seed=11, n=2),
        SamplingParams(max_tokens=26, temperature=0.0, min_tokens=8, stop_token_ids=[40, 41, 42], logprobs=1),
        SamplingParams(max_tokens=22, temperature=0.7, seed=3, frequency_penalty=0.4, presence_penalty=0.2),
    ]
    if guided:
        kinds.append(SamplingParams(max_tokens=12, temperature=0.8, seed=5, guided=GuidedDecoding("regex", "[a-z]+")))
    out = []
    for i in range(n):
        if i % 5 == 4:
            out.append(out[-1])  # a twin of the one before
            continue
        body = rng.integers(3, 250, int(rng.integers(1, max_len))).tolist()
        if i % 3 == 0:
            body = (body[:5] * 12)[: len(body) + 10]  # repeats
        out.append(((shared if i % 2 else []) + body, kinds[i % len(kinds)]))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_every_programs_arrays_equal_the_ones_rebuilt_from_its_chunks(case, assert_kv_all_free):
    config = CASES[case]
    llm = LLM(build_tiny_random(), warm_up=False, **config)
    checks = Checks(llm)
    engine, rng = llm.engine, np.random.default_rng(7)
    pending_requests = workload(rng, 22, 60 if config["max_model_len"] == 128 else 90, guided="multi" not in case)
    added, aborted, steps = 0, 0, 0
    while pending_requests or engine.has_unfinished_requests():
        for _ in range(min(int(rng.integers(0, 3)), len(pending_requests))):
            ids, params = pending_requests.pop(0)
            engine.add_prompt_ids(f"q{added}", ids, params)
            added += 1
        if steps % 10 == 9 and engine.scheduler.running:  # an abort, maybe of a step in flight
            engine.abort(engine.scheduler.running[-1].request_id.split("-")[0])
            aborted += 1
        engine.step()
        steps += 1
    assert not checks.errors, checks.errors[0]
    assert engine.stats.failed_requests == 0
    assert_kv_all_free(engine)
    assert added == 22 and aborted
    changed = sum(len(v) > 1 for v in checks.versions.values())  # decodes whose tables were rewritten
    counts = checks.kinds
    assert counts.get("prefill", 0) and changed, (counts, changed)
    if "multi" in case:
        assert counts.get("multi_decode", 0)
    elif "speculative" in case:
        assert counts.get("verify", 0) and counts.get("decode", 0)
    else:
        assert counts.get("decode", 0) and engine.scheduler.num_preemptions and engine.stats.mixed_steps
