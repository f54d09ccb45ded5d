"""The persistent batch: a step's sampling tensors gathered from slot rows equal the ones built
from each row's settings, whatever joined, left or changed state between steps."""

import numpy as np
import pytest

from jaxserve.request import Request, RequestStatus
from jaxserve.runner.input_batch import InputBatch
from jaxserve.sampler import BIAS_SLOTS, RowSampling, SamplingTensors
from jaxserve.sampling_params import SamplingParams

SLOTS = 4


def filled(shape, dtype, fill):
    return np.full(shape, fill, dtype)


def running(rid: str, params: SamplingParams, seed: int, outputs: int = 0) -> Request:
    req = Request(rid, [5, 6, 7], params, seed=seed, eos_token_ids=(2,))
    req.status = RequestStatus.RUNNING
    req.output_token_ids = list(range(10, 10 + outputs))
    return req


def built(batch: InputBatch, rows: list[tuple[int, Request, int]], num_rows: int, masked: bool) -> SamplingTensors:
    """What SamplingTensors.build makes of the same rows (the reference)."""
    settings = [None] * num_rows
    for row, req, ahead in rows:
        banned = len(req.output_token_ids) + ahead < req.params.min_tokens
        settings[row] = RowSampling(
            req.params, req.seed, req.num_tokens + ahead,
            banned_ids=tuple(req.stop_token_ids) if banned else (),
            penalty_slot=batch.slot(req) if req.params.has_penalties else -1,
            token_mask=np.full(batch.mask_words, -1, np.int32) if masked and row == rows[0][0] else None)
    return SamplingTensors.build(settings, num_rows, batch.spare, mask_words=batch.mask_words)


def assert_same(a: SamplingTensors, b: SamplingTensors) -> None:
    for name in a.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, logprobs=2),
    SamplingParams(temperature=1.0, min_tokens=3, frequency_penalty=0.5, logit_bias={4: 1.5}),
    SamplingParams(temperature=0.5, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.2),
]


def test_gathered_rows_equal_built_rows_as_requests_join_leave_and_pass_min_tokens():
    batch = InputBatch(SLOTS, filled, mask_words=3)
    reqs = [running(f"r{i}", p, seed=100 + i, outputs=i) for i, p in enumerate(MIXED)]
    for step in range(5):
        for req in reqs:
            batch.join(req)
        rows = [(j, req, 0) for j, req in enumerate(reversed(reqs))]  # any order, not slot order
        for masked in (False, True):
            assert_same(batch.sampling(rows, 6, masked), built(batch, rows, 6, masked))
        for req in reqs:
            req.output_token_ids.append(1)  # r2 passes its min_tokens at the second step
        if step == 2:  # one leaves, a new one takes its slot
            reqs[1].status = RequestStatus.FINISHED
            batch.release_finished()
            reqs[1] = running("late", SamplingParams(temperature=0.3, logit_bias={9: -2.0}, min_tokens=9), seed=5)
    assert len(batch) == SLOTS


def test_draft_rows_sample_positions_ahead_with_their_own_stop_token_ban():
    batch = InputBatch(SLOTS, filled, mask_words=0)
    req = running("v", SamplingParams(temperature=0.0, min_tokens=3), seed=0, outputs=1)
    batch.join(req)
    rows = [(j, req, j) for j in range(4)]  # banned at 0 and 1 drafts ahead, free from 2
    t = batch.sampling(rows, 4, masked=False)
    assert_same(t, built(batch, rows, 4, False))
    assert list(t.positions) == [4, 5, 6, 7]
    assert [bool((t.bias_ids[j] == 2).any()) for j in range(4)] == [True, True, False, False]


def test_slots_are_reused_and_penalty_rows_start_unset():
    batch = InputBatch(2, filled, mask_words=0)
    a = running("a", SamplingParams(presence_penalty=1.0), 0)
    b = running("b", SamplingParams(), 1)
    batch.join(a), batch.join(b), batch.join(a)
    assert {batch.slot(a), batch.slot(b)} == {0, 1} and batch.unset == {a}
    before = batch.sampling([(0, a, 0)], 2, masked=False)
    a.status = RequestStatus.PREEMPTED  # leaves; comes back with a fresh slot and an unset row
    batch.release_finished()
    assert batch.unset == set() and len(batch) == 1
    c = running("c", SamplingParams(temperature=0.9, seed=3), 3)
    batch.join(c)
    assert batch.slot(c) == 0
    assert before.presence_penalty[0] == 1.0 and before.penalty_slots[0] == 0  # arrays handed out stay
    with pytest.raises(KeyError):
        batch.sampling([(0, a, 0)], 2, masked=False)


def test_tables_no_row_uses_come_from_the_constant_arrays():
    made = []

    def constant(shape, dtype, fill):
        made.append(shape)
        return np.full(shape, fill, dtype)

    batch = InputBatch(SLOTS, constant, mask_words=2)
    plain = running("p", SamplingParams(temperature=0.0), 0)
    biased = running("b", SamplingParams(logit_bias={3: 2.0}), 1)
    batch.join(plain), batch.join(biased)
    made.clear()
    t = batch.sampling([(1, plain, 0)], 3, masked=False)
    assert made == [(3, BIAS_SLOTS), (3, BIAS_SLOTS), (3, 2)]
    assert list(t.penalty_slots) == [SLOTS] * 3 and list(t.temperature) == [0.0] * 3
    made.clear()
    t = batch.sampling([(0, plain, 0), (2, biased, 0)], 3, masked=True)
    assert made == []  # a biased row and a masked batch: host tables to write into
    assert t.bias_ids[2, 0] == 3 and (t.bias_ids[:2] == -1).all() and (t.token_mask == -1).all()
