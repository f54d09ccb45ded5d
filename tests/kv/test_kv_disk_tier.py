"""The disk tier under the host tier, with fake KV (a token's KV is its id, see kv_sim).

Property test: random admit / load / step / preempt / swap / evict / finish workloads against a
manager with a small host tier and a disk tier of a few blocks. After every call the managers'
invariants (a block in one place per tier, host slots held by the tree, swapped requests or
loads and nothing else, the disk within its byte budget); after every step every running
request and every cached block (host blocks that came from disk included) reads back as its
tokens. At the end every block and slot is free, the disk index equals the files on disk and
every file holds exactly its tokens, also after the shutdown flush. Then: a restart on the same
directory finds the blocks, a damaged file is dropped (never loaded), two managers on one directory
share blocks, and the shutdown flush writes the most recently used cached blocks within the budget.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kv_sim import FakeEngine, as_block_arrays, new_host_array

from jaxserve.kv import (
    ChainKeys,
    CopyKind,
    DiskTier,
    HostBlockArrays,
    KVCacheManager,
    LoadStart,
    LowerTierLink,
    NoTierLink,
    TierLink,
    build_kv_manager,
    fingerprint,
)
from jaxserve.kv.block_files import HEADER_BYTES, SUFFIX

BS = 4
FP = fingerprint({"model": "fake", "block_size": BS})
FILE = HEADER_BYTES + 4 * BS + 8 * BS  # one block file: header, int32 tokens, int64 "KV"
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 2, 3, 0, 0], [2] * 13, []]


def make(
    tmp: Path, num_blocks: int, host_slots: int, disk_blocks: int, hits: int = 0, watermark: int = 0
) -> FakeEngine:
    host = new_host_array(host_slots, BS)
    disk = DiskTier(tmp, FP, BS, HostBlockArrays([as_block_arrays(host)]), disk_blocks * FILE)
    mgr = build_kv_manager(
        num_blocks, BS, watermark_blocks=watermark, num_host_slots=host_slots, lower_tier=disk, write_through_hits=hits
    )
    return FakeEngine(mgr, host=host)


class Driver:
    """Admissions that go through the disk tier the way the scheduler's do."""

    def __init__(self, eng: FakeEngine) -> None:
        self.eng = eng
        self.loading: dict[str, list[int]] = {}

    def admit(self, rid: str, prompt: list[int], chunk: int) -> object:
        mgr = self.eng.mgr
        hit = mgr.match_prefix(prompt)
        if hit.num_disk_tokens:
            started = mgr.loads.start(rid, hit)
            if started is LoadStart.STARTED:
                assert mgr.loads.is_loading(rid)
                self.loading[rid] = prompt
                return "loading"
            if started is LoadStart.BUSY:
                return None
        ok = self.eng.admit(rid, prompt, chunk)
        if not ok:
            self.eng.waiting[rid] = prompt
        return ok

    def poll(self, wait: bool) -> None:
        mgr = self.eng.mgr
        if wait and mgr.loads.pending:
            self.eng.execute_copies()  # what the next launch runs first; then the reads start
            mgr.tier_link.tier.wait(5)
        mgr.loads.poll()
        for rid in [r for r in self.loading if not mgr.loads.is_loading(r)]:
            self.eng.waiting[rid] = self.loading.pop(rid)  # loaded: admitted at its next turn

    def cancel(self, i: int) -> None:
        if self.loading:
            rid = sorted(self.loading)[i % len(self.loading)]
            del self.loading[rid]
            self.eng.mgr.loads.cancel(rid)

    def drain(self) -> None:
        mgr = self.eng.mgr
        for rid in list(self.loading):
            mgr.loads.cancel(rid)
        self.loading.clear()
        self.eng.execute_copies()
        while mgr.loads.pending:
            mgr.tier_link.tier.wait(5)
            mgr.loads.poll()
        for rid in list(self.eng.waiting):
            mgr.loads.cancel(rid)  # loaded but never admitted
        mgr.flush_to_disk()  # a clean shutdown: what is cached goes to disk, within budget
        self.eng.execute_copies()
        mgr.tier_link.tier.flush()
        check_disk_files(mgr.tier_link.tier)
        self.eng.drain()
        mgr.tier_link.tier.flush()
        check_disk_files(mgr.tier_link.tier)


def check_disk_files(disk: DiskTier) -> None:
    """The index is exactly the files on disk, and every file holds its own tokens as its KV."""
    files = {p.name: p for p in disk.root.glob("*/*" + SUFFIX)}
    assert sorted(files) == sorted(k.hex() + SUFFIX for k in disk._index), "index differs from the files"
    assert disk.num_bytes == len(files) * FILE <= disk.capacity_bytes
    for path in files.values():
        data = path.read_bytes()
        tokens = np.frombuffer(data[HEADER_BYTES : HEADER_BYTES + 4 * BS], np.int32)
        kv = np.frombuffer(data[HEADER_BYTES + 4 * BS :], np.int64)
        np.testing.assert_array_equal(kv, tokens, err_msg=f"{path.name} holds another block's KV")


index = st.integers(0, 99)
ACTIONS = [
    st.tuples(
        st.just("admit"), st.integers(0, len(PROMPTS) - 1), st.lists(st.integers(0, 3), max_size=9), st.integers(1, 12)
    ),
    st.tuples(st.just("readmit"), index, st.integers(1, 12)),
    st.tuples(st.just("step"), index, st.integers(1, 6), st.integers(0, 3)),
    st.tuples(st.just("step"), index, st.integers(1, 6), st.integers(0, 3)),
    st.tuples(st.just("poll"), st.booleans()),
    st.tuples(st.just("poll"), st.booleans()),
    st.tuples(st.just("cancel"), index),
    st.tuples(st.just("preempt"), index),
    st.tuples(st.just("swap_out"), index),
    st.tuples(st.just("swap_in"), index),
    st.tuples(st.just("finish"), index),
    st.tuples(st.just("evict"), st.integers(1, 8)),
    st.tuples(st.just("evict_host"), st.integers(1, 8)),
    st.tuples(st.just("clear")),  # drop device and host blocks: what is left is on disk
    st.tuples(st.just("clear")),
]


def _pick(items, i):
    return sorted(items)[i % len(items)] if items else None


def apply(drv: Driver, action: tuple, new_id: str) -> None:
    eng, kind = drv.eng, action[0]
    mgr = eng.mgr
    if kind == "admit":
        prompt = PROMPTS[action[1]] + action[2]
        if prompt:
            drv.admit(new_id, prompt, action[3])
    elif kind == "readmit":
        rid = _pick(eng.waiting, action[1])
        if rid is not None:
            prompt = eng.waiting.pop(rid)
            drv.admit(rid, prompt, action[2])
    elif kind == "poll":
        drv.poll(action[1])
    elif kind == "cancel":
        drv.cancel(action[1])
    elif kind == "evict":
        mgr.prefix_cache.evict(action[1])
    elif kind == "evict_host":
        mgr.prefix_cache.evict_host(action[1])
    elif kind == "clear":
        mgr.prefix_cache.clear()
    elif kind == "swap_in":
        rid = _pick([r for r, q in eng.reqs.items() if q.swapped], action[1])
        if rid is not None:
            eng.swap_in(rid)
    else:
        swapped = [r for r, q in eng.reqs.items() if q.swapped]
        rid = _pick(eng.idle_running() + (swapped if kind == "finish" else []), action[1])
        if rid is None:
            return
        if kind == "step":
            eng.step(rid, action[2], action[3])
        elif kind == "preempt":
            eng.preempt(rid)
        elif kind == "swap_out":
            eng.swap_out(rid)
        elif kind == "finish":
            eng.finish(rid)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    workload=st.lists(st.lists(st.one_of(ACTIONS), min_size=1, max_size=6), min_size=3, max_size=30),
    num_blocks=st.integers(8, 24),
    host_slots=st.sampled_from([4, 12]),
    disk_blocks=st.sampled_from([3, 40]),
    hits=st.sampled_from([0, 0, 2]),
    seeded=st.lists(st.integers(0, 2), max_size=3),
)
def test_tier_invariants_hold_after_every_call(
    tmp_path_factory, workload, num_blocks, host_slots, disk_blocks, hits, seeded
) -> None:
    drv = Driver(make(tmp_path_factory.mktemp("disk"), num_blocks, host_slots, disk_blocks, hits))
    eng = drv.eng
    try:
        for i, p in enumerate(seeded):  # prompts computed earlier: on disk only
            _served(drv, f"seed{i}", PROMPTS[p])
        eng.execute_copies()
        eng.mgr.tier_link.tier.flush()
        eng.mgr.prefix_cache.clear()
        for r, calls in enumerate(workload):
            for c, action in enumerate(calls):
                apply(drv, action, f"r{r}.{c}")
                eng.check_bookkeeping()
            eng.run_step()
            eng.check_bookkeeping()
            eng.check_content()
        stats = eng.mgr.tier_link.tier.stats
        event(f"blocks loaded from disk: {'some' if stats.loaded_blocks else 'none'}")
        event(f"blocks written: {'some' if stats.written_blocks else 'none'}")
        event(f"disk evictions: {'some' if stats.evictions else 'none'}")
        drv.drain()
    finally:
        eng.mgr.tier_link.tier.close()


def _served(drv: Driver, rid: str, prompt: list[int]) -> int:
    """Admit `prompt` (loading from disk when it can), run it, finish it; the tokens not computed."""
    eng = drv.eng
    mgr = eng.mgr
    while True:
        hit = mgr.match_prefix(prompt)
        if hit.num_disk_tokens and mgr.loads.start(rid, hit) is LoadStart.STARTED:
            eng.execute_copies()
            while mgr.loads.is_loading(rid):
                mgr.tier_link.tier.wait(5)
                mgr.loads.poll()
            continue
        break
    assert eng.admit(rid, prompt, len(prompt) - hit.num_tokens)
    eng.run_step()
    eng.check_content()
    eng.finish(rid)
    eng.check_bookkeeping()
    return hit.num_tokens


PROMPT = list(range(1, 26))  # 6 full blocks + 1 token


def _fresh(tmp: Path) -> FakeEngine:
    return make(tmp, num_blocks=16, host_slots=8, disk_blocks=64)


def _close(eng: FakeEngine) -> None:
    eng.execute_copies()  # the writes the last step planned (the next step would run them)
    eng.mgr.tier_link.tier.flush()
    eng.mgr.tier_link.tier.close()


def test_a_restart_finds_the_blocks_on_disk(tmp_path) -> None:
    first = _fresh(tmp_path)
    assert _served(Driver(first), "a", PROMPT) == 0
    _close(first)
    second = _fresh(tmp_path)  # a new process: empty device and host
    assert second.mgr.tier_link.tier.num_blocks == 6  # found by scanning the headers
    assert _served(Driver(second), "b", PROMPT) == 24
    assert second.mgr.tier_link.hit_tokens == 24
    _close(second)


def _wait_loaded(mgr: KVCacheManager, rid: str) -> None:
    while mgr.loads.is_loading(rid):
        mgr.tier_link.tier.wait(5)
        mgr.loads.poll()


def test_a_prefix_loaded_in_parts_is_admitted_with_every_part(tmp_path) -> None:
    """The host tier has room for part of a disk prefix; once room frees up, the request loads
    the rest before it is admitted, and its disk hits count every part."""
    eng = make(tmp_path, num_blocks=16, host_slots=4, disk_blocks=64)
    drv, mgr = Driver(eng), eng.mgr
    _served(drv, "a", PROMPT)
    eng.execute_copies()
    mgr.tier_link.tier.flush()
    mgr.prefix_cache.clear()  # PROMPT's 6 blocks are on disk only
    assert eng.admit("s", [40 + i for i in range(7)], 7)
    eng.run_step()
    assert eng.swap_out("s")  # it holds 2 of the 4 host slots
    eng.execute_copies()
    hit = mgr.match_prefix(PROMPT)
    assert (hit.num_tokens, hit.num_disk_tokens) == (0, 24)
    assert mgr.loads.start("b", hit) is LoadStart.STARTED
    eng.execute_copies()
    _wait_loaded(mgr, "b")
    first = mgr.match_prefix(PROMPT)
    assert first.num_host_tokens == 8 and first.num_disk_tokens == 16  # room for 2 blocks only
    assert eng.swap_in("s")
    eng.execute_copies()
    eng.finish("s")  # its host slots are free again
    rest = mgr.match_prefix(PROMPT)
    assert mgr.loads.start("b", rest) is LoadStart.STARTED
    eng.execute_copies()
    _wait_loaded(mgr, "b")
    final = mgr.match_prefix(PROMPT)
    assert final.num_host_tokens == 16 and final.num_disk_tokens == 8
    assert eng.admit("b", PROMPT, len(PROMPT) - final.num_tokens)
    assert mgr.tier_link.hit_tokens == 16  # both parts: 8 tokens each
    eng.run_step()
    eng.check_content()
    eng.finish("b")
    eng.check_bookkeeping()
    _close(eng)


def test_a_damaged_file_is_dropped_and_recomputed_never_served(tmp_path) -> None:
    first = _fresh(tmp_path)
    _served(Driver(first), "a", PROMPT)
    _close(first)
    disk_root = first.mgr.tier_link.tier.root
    paths = sorted(disk_root.glob("*/*" + SUFFIX))
    keys = ChainKeys(FP, BS).keys(PROMPT, 6)
    third = disk_root / keys[2].hex()[:2] / (keys[2].hex() + SUFFIX)
    data = bytearray(third.read_bytes())
    data[-3] ^= 0xFF  # one flipped bit of KV: same length, bad checksum
    third.write_bytes(bytes(data))
    assert len(paths) == 6
    second = _fresh(tmp_path)
    assert _served(Driver(second), "b", PROMPT) == 8  # blocks 0-1 loaded, 2 on recomputed
    assert not third.exists()
    assert second.mgr.tier_link.tier.stats.damaged == 1
    _close(second)
    # A truncated file is caught by the scan at start.
    fourth = disk_root / keys[3].hex()[:2] / (keys[3].hex() + SUFFIX)
    fourth.write_bytes(fourth.read_bytes()[:-5])
    again = _fresh(tmp_path)
    assert not fourth.exists() and again.mgr.tier_link.tier.stats.damaged == 1
    _close(again)


def test_two_managers_on_one_directory_share_blocks(tmp_path) -> None:
    a, b = _fresh(tmp_path), _fresh(tmp_path)  # both running: b scanned before a wrote
    assert _served(Driver(a), "a", PROMPT) == 0
    a.execute_copies()
    a.mgr.tier_link.tier.flush()
    assert _served(Driver(b), "b", PROMPT) == 24  # found with a stat of the next key
    _close(a)
    _close(b)


def test_the_shutdown_flush_writes_what_is_cached_newest_first_within_the_budget(tmp_path) -> None:
    older, newer = PROMPT, list(range(100, 125))  # 6 full blocks each
    eng = make(tmp_path, num_blocks=16, host_slots=8, disk_blocks=8, hits=100)  # no write-through
    _served(Driver(eng), "a", older)
    eng.mgr.prefix_cache.evict(6)  # spilled: the older prompt is on the host
    eng.execute_copies()
    _served(Driver(eng), "b", newer)
    assert eng.mgr.tier_link.tier.stats.written_blocks == 0
    assert eng.mgr.flush_to_disk() == 8  # the budget: 6 newer blocks, 2 older ones
    eng.execute_copies()
    eng.mgr.tier_link.tier.flush()
    check_disk_files(eng.mgr.tier_link.tier)
    assert eng.mgr.flush_to_disk() == 0  # all of it is on disk, or does not fit
    _close(eng)
    again = make(tmp_path, num_blocks=16, host_slots=8, disk_blocks=8, hits=100)  # the restart
    assert again.mgr.tier_link.tier.num_blocks == 8
    assert _served(Driver(again), "b", newer) == 24  # whole: no block of its chain is missing
    assert _served(Driver(again), "a", older) == 8  # its first two blocks; the rest recomputed
    _close(again)


def test_bad_settings_are_refused(tmp_path) -> None:
    host = new_host_array(4, BS)
    disk = DiskTier(tmp_path, FP, BS, HostBlockArrays([as_block_arrays(host)]), 10 * FILE)
    try:
        with pytest.raises(ValueError, match="host"):
            build_kv_manager(16, BS, num_host_slots=0, lower_tier=disk)
        with pytest.raises(ValueError, match="prefix cache"):
            build_kv_manager(16, BS, num_host_slots=4, enable_prefix_cache=False, lower_tier=disk)
        with pytest.raises(ValueError, match="write_through_hits"):
            build_kv_manager(16, BS, num_host_slots=4, lower_tier=disk, write_through_hits=-1)
    finally:
        disk.close()
    with pytest.raises(ValueError, match="budget"):
        DiskTier(tmp_path, FP, BS, HostBlockArrays([as_block_arrays(host)]), 0)


def test_without_a_disk_tier_the_link_below_the_host_tier_stores_and_loads_nothing(tmp_path: Path) -> None:
    eng = make(tmp_path, 16, 4, 4)
    assert isinstance(eng.mgr.tier_link, TierLink) and isinstance(eng.mgr.tier_link, LowerTierLink)
    eng.mgr.tier_link.tier.close()
    mgr = build_kv_manager(16, BS, num_host_slots=4)
    assert isinstance(mgr.tier_link, NoTierLink) and isinstance(mgr.tier_link, LowerTierLink)
    prompt = PROMPTS[0]
    hit = mgr.match_prefix(prompt)
    assert hit.num_disk_tokens == 0 and mgr.loads.start("r", hit) is LoadStart.NONE
    assert not mgr.loads.pending and not mgr.loads.is_loading("r")
    handle = mgr.admit(hit, len(prompt))
    assert mgr.cache_full_blocks(handle, prompt) == len(prompt) // BS
    assert not [s for s in mgr.take_copies() if s.kind in (CopyKind.DEVICE_TO_DISK, CopyKind.HOST_TO_DISK)]
    assert mgr.flush_to_disk() == 0 and not mgr.take_copies()
    mgr.free(handle)
    mgr.check_integrity()
    assert mgr.usage().used == 0
