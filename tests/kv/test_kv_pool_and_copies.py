"""Block pool, host tier and copy plan on their own."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxserve.kv import BlockPool, CopyKind, CopyPlan, HostTier, NoFreeBlocksError


def test_pool_never_hands_out_block_zero_and_frees_in_constant_steps() -> None:
    pool = BlockPool(9, block_size=16)
    blocks = pool.allocate(8)
    assert sorted(blocks) == list(range(1, 9))
    assert pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.incref(blocks[0])
    assert not pool.decref(blocks[0])
    assert pool.decref(blocks[0])
    assert pool.refcount[blocks[0]] == 0 and pool.num_free == 1
    pool.decref_all(blocks[1:])
    pool.check_integrity([0] * 9)


def test_pool_rejects_double_free_and_incref_of_free_block() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.decref(block)
    with pytest.raises(ValueError, match="double free"):
        pool.decref(block)
    with pytest.raises(ValueError, match="not allocated"):
        pool.incref(block)
    with pytest.raises(ValueError):
        BlockPool(1)


def test_pool_integrity_catches_wrong_counts() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(AssertionError, match="holders"):
        pool.check_integrity([0, 1, 0, 0])


def test_host_tier_capacity_and_double_free() -> None:
    host = HostTier(3)
    host_slots = host.allocate(3)
    assert sorted(host_slots) == [0, 1, 2] and host.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        host.allocate(1)
    host.free(host_slots[:1])
    with pytest.raises(ValueError, match="twice"):
        host.free(host_slots[:1])
    host.check_integrity(host_slots[1:])
    with pytest.raises(AssertionError):
        host.check_integrity(host_slots)


def test_copy_plan_splits_stages_at_hazards_only() -> None:
    plan = CopyPlan()
    plan.add(CopyKind.DEVICE_TO_HOST, 5, 0)
    plan.add(CopyKind.DEVICE_TO_HOST, 0, 1)  # reads device 0, writes host 1: no hazard
    plan.add(CopyKind.DEVICE_TO_HOST, 6, 1)  # host slot 1 written twice: new stage
    plan.add(CopyKind.HOST_TO_DEVICE, 1, 7)  # another kind: new stage
    plan.add(CopyKind.HOST_TO_DEVICE, 7, 8)  # reads host slot 7, not the device block 7 written: no hazard
    plan.add(CopyKind.DEVICE_TO_DISK, 8, 0)  # another kind: new stage
    plan.add(CopyKind.DEVICE_TO_DISK, 8, 1)  # one block to two tickets: no hazard
    plan.add(CopyKind.HOST_TO_DISK, 8, 1)  # another kind: new stage
    plan.add(CopyKind.STATE, 3, 4)  # another kind: new stage
    plan.add(CopyKind.STATE, 4, 5)  # reads state slot 4, which this stage writes: new stage
    stages = plan.take()
    assert [(s.kind, s.pairs) for s in stages] == [
        (CopyKind.DEVICE_TO_HOST, [(5, 0), (0, 1)]),
        (CopyKind.DEVICE_TO_HOST, [(6, 1)]),
        (CopyKind.HOST_TO_DEVICE, [(1, 7), (7, 8)]),
        (CopyKind.DEVICE_TO_DISK, [(8, 0), (8, 1)]),
        (CopyKind.HOST_TO_DISK, [(8, 1)]),
        (CopyKind.STATE, [(3, 4)]),
        (CopyKind.STATE, [(4, 5)]),
    ]
    assert stages[0].as_array().tolist() == [[5, 0], [0, 1]]
    assert not plan and plan.take() == []


copy_op = st.tuples(st.sampled_from(list(CopyKind)), st.integers(0, 5), st.integers(0, 5))


@given(st.lists(copy_op, max_size=30))
def test_staged_batched_copies_equal_one_by_one_copies(ops: list[tuple]) -> None:
    """Running each stage as one gather + one scatter gives what running copies in order gives
    (writes to the disk tier included: their destination is a ticket, modelled as a third space)."""

    def spaces(device, host, disk, state):
        return {
            CopyKind.DEVICE_TO_HOST: (device, host),
            CopyKind.HOST_TO_DEVICE: (host, device),
            CopyKind.DEVICE_TO_DISK: (device, disk),
            CopyKind.HOST_TO_DISK: (host, disk),
            CopyKind.STATE: (state, state),  # a hybrid's state slots: read and written in one space
        }

    seq = np.arange(6), np.arange(100, 106), np.full(6, -1), np.arange(200, 206)
    for kind, src, dst in ops:
        a, b = spaces(*seq)[kind]
        b[dst] = a[src]
    plan = CopyPlan()
    for kind, src, dst in ops:
        plan.add(kind, src, dst)
    staged = np.arange(6), np.arange(100, 106), np.full(6, -1), np.arange(200, 206)
    for stage in plan.take():
        a, b = spaces(*staged)[stage.kind]
        b[stage.dst] = a[stage.src]
    assert [s.tolist() for s in staged] == [s.tolist() for s in seq]
