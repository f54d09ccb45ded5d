"""A hybrid model's state slots: one per admitted sequence from admission to free, kept while
swapped out, counted in admission (none free: not admitted), all free again at the end."""

import pytest

from jaxserve.kv import build_kv_manager
from jaxserve.kv.state_slots import StateSlots


def admit(mgr, tokens: list[int]):
    return mgr.admit(mgr.match_prefix(tokens), len(tokens) - mgr.match_prefix(tokens).num_tokens)


def test_admission_takes_a_slot_and_free_returns_it():
    mgr = build_kv_manager(64, 4, num_state_slots=3, enable_prefix_cache=False, num_host_slots=16)
    a, b = admit(mgr, list(range(10))), admit(mgr, list(range(20, 27)))
    assert {a.state_slot, b.state_slot} == {1, 2}
    hit = mgr.match_prefix(list(range(40, 45)))
    assert not mgr.can_admit(hit, 5) and mgr.admit(hit, 5) is None  # blocks to spare, but no slot
    mgr.check_integrity()
    assert mgr.swap_out(a) and a.state_slot is not None  # the state stays on the device
    mgr.check_integrity()
    mgr.free(b)
    assert b.state_slot is None and mgr.state_slots.num_free == 1
    c = admit(mgr, list(range(40, 45)))
    assert c.state_slot == 2
    mgr.free(a)
    mgr.free(c)
    mgr.check_integrity()
    assert mgr.state_slots.num_free == 2


def test_a_model_without_state_holds_no_slots():
    mgr = build_kv_manager(16, 4)
    handle = admit(mgr, list(range(9)))
    assert handle.state_slot is None and not mgr.state_slots.enabled
    mgr.free(handle)
    mgr.check_integrity()


def test_slot_bookkeeping_errors():
    slots = StateSlots(3)
    with pytest.raises(ValueError):
        slots.free(1)
    one = slots.allocate()
    slots.check_integrity([one])
    with pytest.raises(AssertionError):
        slots.check_integrity([])
    with pytest.raises(ValueError):
        StateSlots(1)
