"""KV cache manager edge cases: swap under pressure, watermark, pins, table versions."""

from __future__ import annotations

import numpy as np
import pytest
from kv_sim import FakeEngine

from jaxserve.kv import CopyKind, build_kv_manager

BS = 4


def engine(num_blocks: int = 32, **kwargs) -> FakeEngine:
    kwargs.setdefault("watermark_blocks", 0)
    return FakeEngine(build_kv_manager(num_blocks, BS, **kwargs))


def settle(eng: FakeEngine) -> None:
    """Run the step and check everything."""
    eng.run_step()
    eng.check_bookkeeping()
    eng.check_content()


def test_swap_in_when_the_pool_is_full_waits_then_restores_content() -> None:
    eng = engine(num_blocks=9, num_host_slots=8)  # 8 usable blocks
    mgr = eng.mgr
    assert eng.admit("a", list(range(10, 22)), chunk=12)  # 3 blocks
    settle(eng)
    assert eng.swap_out("a")
    settle(eng)
    assert eng.admit("b", list(range(30, 50)), chunk=20)  # 5 blocks
    assert eng.admit("c", list(range(60, 72)), chunk=12)  # 3 blocks: evicts a's cached ones
    settle(eng)
    before = mgr.usage()
    assert before.free == 0 and before.cached_idle == 0
    assert not mgr.can_swap_in(eng.reqs["a"].kv) and not eng.swap_in("a")
    assert mgr.usage() == before and eng.reqs["a"].kv.host_slots is not None and mgr.take_copies() == []
    eng.finish("c")
    assert eng.swap_in("a")
    settle(eng)
    assert list(eng.content("a")) == list(range(10, 22))
    eng.drain()


def test_swap_in_and_out_again_in_one_round_keeps_content() -> None:
    eng = engine(num_blocks=16, num_host_slots=6)
    assert eng.admit("a", list(range(1, 11)), chunk=10)
    settle(eng)
    assert eng.swap_out("a")
    settle(eng)
    assert eng.swap_in("a") and eng.swap_out("a")  # planned back to back
    assert eng.admit("b", list(range(50, 70)), chunk=20)  # reuses the blocks just freed
    settle(eng)
    assert eng.swap_in("a")
    settle(eng)
    assert list(eng.content("a")) == list(range(1, 11))
    eng.drain()


def test_swap_out_fails_cleanly_when_the_host_is_full() -> None:
    eng = engine(num_blocks=16, num_host_slots=2)
    assert eng.admit("a", list(range(1, 11)), chunk=10)  # 3 blocks > 2 host slots
    settle(eng)
    assert not eng.mgr.can_swap_out(eng.reqs["a"].kv) and not eng.swap_out("a")
    assert eng.reqs["a"].kv.host_slots is None
    eng.drain()
    no_tier = engine()
    assert no_tier.admit("a", [1, 2, 3], chunk=3)
    assert not no_tier.swap_out("a")
    no_tier.drain()


def test_watermark_holds_back_admissions_but_not_running_growth() -> None:
    eng = engine(num_blocks=11, watermark_blocks=2)  # 10 usable
    mgr = eng.mgr
    assert eng.admit("a", list(range(100, 140)), chunk=32)  # 8 blocks, leaves 2
    hit = mgr.match_prefix([1, 2, 3])
    assert not mgr.can_admit(hit, 3) and mgr.admit(hit, 3) is None
    assert eng.step("a", 8, 0)  # growth may use the reserve
    assert mgr.num_available_blocks == 0
    settle(eng)
    eng.drain()


def test_admission_counts_the_idle_blocks_it_is_about_to_lock() -> None:
    eng = engine(num_blocks=9)  # 8 usable
    mgr = eng.mgr
    prompt = list(range(1, 14))
    assert eng.admit("a", prompt, chunk=13)  # 4 blocks, 3 of them full
    settle(eng)
    eng.finish("a")  # 3 cached idle, 5 free
    assert eng.admit("b", list(range(50, 70)), chunk=20)  # takes the 5 free blocks
    hit = mgr.match_prefix(prompt)
    assert hit.num_tokens == 12 and mgr.num_available_blocks == 3
    # Reusing the 3 idle blocks locks them, so nothing is left for the 13th token.
    assert not mgr.can_admit(hit, 1) and mgr.admit(hit, 1) is None
    settle(eng)
    eng.drain()


def test_prefix_hit_on_admission_and_stale_hits() -> None:
    eng = engine()
    mgr = eng.mgr
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    assert eng.admit("a", prompt, chunk=13)
    settle(eng)
    hit = mgr.match_prefix(prompt)
    assert hit.num_tokens == 12 and hit.num_host_tokens == 0
    assert eng.admit("b", [9, 9, 9], chunk=3)
    with pytest.raises(ValueError, match="stale"):
        mgr.admit(hit, 1)
    assert eng.admit("c", prompt, chunk=1)
    assert list(eng.table("c"))[:3] == list(eng.table("a"))[:3]
    settle(eng)
    assert mgr.stats.queries == 3 and mgr.stats.hit_tokens == 12
    eng.drain()


def test_spilled_prefix_comes_back_from_the_host_on_a_hit() -> None:
    eng = engine(num_blocks=9, num_host_slots=8)  # 8 usable device blocks
    mgr = eng.mgr
    prompt = list(range(1, 14))
    assert eng.admit("a", prompt, chunk=13)
    settle(eng)
    eng.finish("a")  # 3 blocks stay cached, idle
    assert eng.admit("b", list(range(50, 82)), chunk=32)  # 8 blocks: a's spill to the host
    settle(eng)
    assert mgr.usage().host_cached == 3
    eng.finish("b")
    hit = mgr.match_prefix(prompt)
    assert hit.num_tokens == 12 and hit.num_host_tokens == 12
    assert eng.admit("a2", prompt, chunk=1)
    stages = mgr.take_copies()  # b's blocks spill, a's come back
    loads = [pair for s in stages if s.kind is CopyKind.HOST_TO_DEVICE for pair in s.pairs]
    assert len(loads) == 3
    eng.execute_copies(stages)
    settle(eng)
    assert list(eng.content("a2")) == prompt
    assert mgr.stats.host_hit_tokens == 12
    eng.drain()


def test_pins_respect_per_owner_budget_and_survive_clearing() -> None:
    eng = engine(num_blocks=64, pin_budget_blocks=3, max_pinned_blocks=5)
    mgr, leases = eng.mgr, eng.mgr.leases
    long, short = list(range(1, 18)), list(range(40, 49))  # 4 and 2 full blocks
    assert eng.admit("a", long, chunk=17) and eng.admit("b", short, chunk=9)
    settle(eng)
    assert leases.pin("alice", long) is None  # 4 blocks > budget 3
    first = leases.pin("alice", long[:12])
    assert first is not None and first.num_blocks == 3
    assert leases.pin("alice", short) is None  # 3 + 2 > 3
    second = leases.pin("alice", short, replacing=first)  # a session's next turn
    assert second is not None and not first.active and leases.pinned_by("alice") == 2
    bob = leases.pin("bob", long[:12])
    assert bob is not None and leases.num_pinned == 5
    assert leases.pin("carol", short) is None  # pool-wide cap
    eng.finish("a")
    eng.finish("b")
    eng.clear_cache()
    assert mgr.prefix_cache.match(long[:12], leave_last_token=False).num_blocks == 3
    assert mgr.prefix_cache.match(short, leave_last_token=False).num_blocks == 2
    assert mgr.usage().pinned == 5
    leases.unpin(second)
    with pytest.raises(ValueError):
        leases.unpin(second)
    leases.unpin(bob)
    eng.drain()


def test_kv_slots_and_block_table_views() -> None:
    eng = engine()
    assert eng.admit("a", list(range(10)), chunk=10)
    handle = eng.reqs["a"].kv
    table = handle.block_table
    assert table.dtype == np.int32 and len(table) == 3 and not table.flags.writeable
    expected = [int(table[p // BS]) * BS + p % BS for p in range(3, 10)]
    assert handle.kv_slots(3, 10).tolist() == expected
    with pytest.raises(ValueError):
        handle.kv_slots(0, 11)
    settle(eng)
    eng.drain()


def test_table_version_changes_when_entries_change_not_when_blocks_are_appended() -> None:
    mgr = build_kv_manager(32, BS, watermark_blocks=0, num_host_slots=16)
    prompt = list(range(6))
    a = mgr.admit(mgr.match_prefix(prompt), 6)  # [0 1 2 3] [4 5 . .]
    version = a.version
    assert mgr.allocate_kv_slots(a, 1) and mgr.allocate_kv_slots(a, 4)  # fills block 1, appends block 2
    assert len(a.block_table) == 3 and a.version == version
    changes = []

    def changed(what: str) -> None:
        nonlocal version
        changes.append((what, a.version != version))
        version = a.version

    assert mgr.allocate_kv_slots(a, 1)  # into the last block
    changed("growth within the last block")
    assert mgr.release_kv_slots(a, 10) is None  # within the last block: nothing freed
    changed("a release within the last block")
    assert mgr.release_kv_slots(a, 8) is None  # frees block 2
    changed("a release freeing a block")
    assert mgr.swap_out(a)
    changed("swap out")
    assert mgr.swap_in(a)
    changed("swap in")
    assert changes == [
        ("growth within the last block", False),
        ("a release within the last block", False),
        ("a release freeing a block", True),
        ("swap out", True),
        ("swap in", True),
    ]
    versions = {a.version}
    mgr.free(a)
    again = mgr.admit(mgr.match_prefix(prompt), 6)  # admitted again: a version never seen
    assert again.version not in versions | {version}


def test_a_block_swapped_for_the_caches_copy_changes_the_version() -> None:
    mgr = build_kv_manager(32, BS, watermark_blocks=0)
    ids = list(range(9))
    a, b = (mgr.admit(mgr.match_prefix(ids), 9) for _ in range(2))  # the same tokens, computed twice
    mgr.cache_full_blocks(a, ids)
    before = b.block_table.tolist(), b.version
    mgr.cache_full_blocks(b, ids)  # b switches to a's cached blocks
    after = b.block_table.tolist(), b.version
    assert after[0][:2] == a.block_table.tolist()[:2] != before[0][:2]
    assert after[1] != before[1]
    mgr.cache_full_blocks(b, ids)  # nothing new: the version stays
    assert b.version == after[1]


def test_bad_calls_get_clear_errors() -> None:
    eng = engine(num_host_slots=8)
    mgr = eng.mgr
    assert eng.admit("a", [1, 2, 3, 4, 5], chunk=5)
    a = eng.reqs["a"].kv
    with pytest.raises(ValueError):
        mgr.allocate_kv_slots(a, -1)
    with pytest.raises(ValueError, match="KV slots"):
        mgr.cache_full_blocks(a, [1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="not swapped"):
        mgr.swap_in(a)
    settle(eng)
    assert eng.swap_out("a")
    with pytest.raises(ValueError, match="swapped"):
        mgr.allocate_kv_slots(a, 1)
    eng.finish("a")
    with pytest.raises(ValueError, match="freed"):
        mgr.allocate_kv_slots(a, 1)
    with pytest.raises(ValueError, match="freed"):
        mgr.free(a)
    with pytest.raises(ValueError):
        build_kv_manager(8, BS, watermark_blocks=7)
