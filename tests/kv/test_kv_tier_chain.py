"""The disk tier and the pool tier chained (`TierChain`), a real disk tier over a real Mooncake Store
master on loopback: writes go through to each tier that lacks a block, lookups and loads take each
block from the disk when it holds it and from the pool otherwise, and a dead master leaves the disk
serving."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kv_sim import FakeEngine, as_block_arrays, new_host_array, random_blocks

from jaxserve.kv import DiskTier, HostBlockArrays, KVTier, LoadStart, PoolTier, TierChain, build_kv_manager, fingerprint
from jaxserve.kv.kv_tier import LoadJob
from jaxserve.kv.tier_stats import TierStats
from jaxserve.mooncake_store import MooncakeBlockStore
from server.cluster.launch.mooncake_master import PoolMaster, mooncake_missing

if (why := mooncake_missing()) is not None:
    pytest.skip(why, allow_module_level=True)

BS = 4
SHAPE = (2, 3, 8, BS, 5)  # layers, kv heads, host slots, block size, head dim
FP = fingerprint({"model": "chain-test"})


def host_arrays() -> list[np.ndarray]:
    return [HostBlockArrays.allocate(SHAPE, np.float32), HostBlockArrays.allocate(SHAPE, np.float32)]


def disk_tier(directory, arrays: list[np.ndarray]) -> DiskTier:
    return DiskTier(directory, FP, BS, HostBlockArrays(arrays), 1 << 20)


def pool_tier(master: PoolMaster, host: list[np.ndarray] | HostBlockArrays) -> PoolTier:
    store = MooncakeBlockStore(master.url, "127.0.0.1", 32 << 20)
    host = host if isinstance(host, HostBlockArrays) else HostBlockArrays(host)
    return PoolTier(store, FP, BS, host, 32 << 20, staging_blocks=3, probe_seconds=0.2)


def chain(directory, master: PoolMaster) -> tuple[TierChain, list[np.ndarray]]:
    arrays = host_arrays()
    return TierChain(disk_tier(directory, arrays), pool_tier(master, arrays)), arrays


def write(tier: KVTier, keys, tokens, arrays, chosen: list[int]) -> list[int | None]:
    """Plan blocks `chosen` and hand their bytes over as the runner does; wait for the writes."""
    tickets = [tier.plan_write(keys[i], tokens[i]) for i in chosen]
    planned = [i for i, t in zip(chosen, tickets) if t is not None]
    tier.write([t for t in tickets if t is not None], [a[:, :, planned] for a in arrays])
    tier.flush()
    return tickets


def load(tier: KVTier, keys, tokens, slots) -> LoadJob:
    job = tier.start_load(keys, tokens, slots)
    deadline = time.monotonic() + 30
    while not job.done and time.monotonic() < deadline:
        tier.wait(0.1)
        if job in tier.poll():
            break
    assert job.done
    return job


def assert_loaded(host: list[np.ndarray], arrays: list[np.ndarray], blocks_slots: list[tuple[int, int]]) -> None:
    for i, slot in blocks_slots:
        for h, a in zip(host, arrays):
            np.testing.assert_array_equal(h[:, :, slot], a[:, :, i])


def test_writes_go_through_to_each_tier_that_lacks_the_block(tmp_path, master):
    tier, _ = chain(tmp_path / "a", master)
    keys, tokens, arrays = random_blocks(0, 3, SHAPE)
    write(tier.upper, keys, tokens, arrays, [0])  # block 0 on the disk only
    assert not tier.lower.contains(keys[0])
    assert all(t is not None for t in write(tier, keys, tokens, arrays, [0, 1, 2]))
    assert tier.upper.stats.written_blocks == 3 and tier.lower.stats.written_blocks == 3
    assert tier.upper.num_leading(keys) == 3 and tier.lower.num_leading(keys) == 3
    assert write(tier, keys, tokens, arrays, [0, 1, 2]) == [None, None, None]  # both hold them
    # Another engine's disk tier and pool tier read back what each one was given.
    other, host = chain(tmp_path / "b", master)
    assert other.upper.num_leading(keys) == 0 and other.num_leading(keys) == 3
    job = load(other, keys, tokens, [5, 6, 7])
    assert job.loaded == 3 and job.sources == [("pool", 3)]
    assert_loaded(host, arrays, [(0, 5), (1, 6), (2, 7)])
    disk_only = host_arrays()
    disk_host = disk_tier(tmp_path / "a", disk_only)
    assert load(disk_host, keys, tokens, [0, 1, 2]).loaded == 3
    assert_loaded(disk_only, arrays, [(0, 0), (1, 1), (2, 2)])  # block 0 was not written twice, 1 and 2 were
    for t in (tier, other, disk_host):
        t.close()


def test_each_block_is_read_from_the_tier_that_holds_it(tmp_path, master):
    tier, host = chain(tmp_path, master)
    keys, tokens, arrays = random_blocks(1, 6, SHAPE)
    write(tier.upper, keys, tokens, arrays, [0, 1, 3])
    write(tier.lower, keys, tokens, arrays, [1, 2, 4])
    assert tier.contains(keys[2]) and not tier.contains(keys[5])
    assert tier.num_leading(keys) == 5 and tier.num_leading(keys[1:]) == 4
    job = load(tier, keys[:5], tokens[:5], [7, 6, 5, 4, 3])
    assert job.loaded == 5
    assert job.sources == [("disk", 2), ("pool", 1), ("disk", 1), ("pool", 1)]
    assert_loaded(host, arrays, [(0, 7), (1, 6), (2, 5), (3, 4), (4, 3)])
    assert tier.upper.stats.loaded_blocks == 3 and tier.lower.stats.loaded_blocks == 2
    assert tier.stats.loaded_blocks == 5 and tier.stats.loads == tier.upper.stats.loads + tier.lower.stats.loads
    tier.check_integrity()
    tier.close()


def test_a_load_stops_at_the_first_block_missing_from_its_tier(tmp_path, master):
    tier, _ = chain(tmp_path, master)
    keys, tokens, arrays = random_blocks(2, 4, SHAPE)
    write(tier.upper, keys, tokens, arrays, [0, 1, 3])  # block 2 is nowhere: asked of the pool, missing
    job = load(tier, keys, tokens, [0, 1, 2, 3])
    assert job.sources == [("disk", 2), ("pool", 1), ("disk", 1)]
    assert job.loaded == 2 and tier.lower.stats.missing == 1  # block 3 read, but after a gap: not counted
    tier.close()


def test_a_dead_master_leaves_the_disk_serving(tmp_path):
    m = PoolMaster()
    m.start()
    try:
        tier, host = chain(tmp_path, m)
        keys, tokens, arrays = random_blocks(3, 4, SHAPE)
        write(tier, keys, tokens, arrays, [0, 1])
        m.kill()
        assert tier.num_leading(keys) == 2 and not tier.lower.is_up  # the disk's, answered at once
        assert tier.can_load(2)
        job = load(tier, keys[:2], tokens[:2], [0, 1])
        assert job.loaded == 2 and job.sources == [("disk", 2)]
        assert_loaded(host, arrays, [(0, 0), (1, 1)])
        write(tier, keys, tokens, arrays, [2, 3])  # the disk's writes go on, the pool's are dropped
        assert tier.upper.num_leading(keys) == 4 and tier.lower.stats.written_blocks == 2
        tier.check_integrity()
        tier.close()
        assert tier.closed
    finally:
        m.kill()


def fake_engine(make_tier) -> FakeEngine:
    """A KV manager (kv_sim's token-id blocks) over the tier `make_tier` builds on its host slots."""
    host = new_host_array(8, BS)
    tier = make_tier(HostBlockArrays([as_block_arrays(host)]))
    return FakeEngine(build_kv_manager(24, BS, watermark_blocks=0, num_host_slots=8, lower_tier=tier), host=host)


def compute(eng: FakeEngine, prompt: list[int]) -> None:
    """Prefill `prompt`: its full blocks enter the cache and are written through to the tier."""
    assert eng.admit("r", prompt, chunk=len(prompt))
    eng.run_step()
    eng.execute_copies()
    eng.mgr.tier_link.tier.flush()


def test_a_prefix_loaded_from_both_tiers_counts_its_hits_per_tier(tmp_path, master):
    prompt = list(range(300, 317))  # 4 full blocks and a token
    on_disk = fake_engine(lambda host: DiskTier(tmp_path, FP, BS, host, 1 << 20))
    compute(on_disk, prompt[:9])  # blocks 0 and 1 on the disk
    in_pool = fake_engine(lambda host: pool_tier(master, host))
    compute(in_pool, prompt)  # blocks 0 to 3 in the pool
    both = fake_engine(lambda host: TierChain(DiskTier(tmp_path, FP, BS, host, 1 << 20), pool_tier(master, host)))
    hit = both.mgr.match_prefix(prompt)
    assert hit.num_tokens == 0 and hit.num_disk_tokens == 16
    assert both.mgr.loads.start("r", hit) is LoadStart.STARTED
    both.execute_copies()  # the planned copies run, then the load is submitted
    deadline = time.monotonic() + 30
    while not both.mgr.loads.poll() and time.monotonic() < deadline:
        both.mgr.tier_link.tier.wait(0.1)
    assert both.admit("r", prompt, chunk=1)  # 16 tokens from the host tier, the last one computed
    both.run_step()
    both.check_bookkeeping()
    both.check_content()
    assert list(both.content("r")) == prompt
    assert both.mgr.tier_link.hit_tokens_by_tier == {"disk": 8, "pool": 8}
    stats = TierStats.of(both.mgr)
    assert stats.lower_tiers == ("disk", "pool") and stats.host_hit_tokens == 16
    assert (stats.disk_hit_tokens, stats.pool_hit_tokens, stats.disk_loaded_blocks, stats.pool_loaded_blocks) == (
        8,
        8,
        2,
        2,
    )
    for eng in (on_disk, in_pool, both):
        eng.drain()
        eng.mgr.tier_link.tier.close()


def test_the_tiers_must_share_a_fingerprint(tmp_path):
    arrays = host_arrays()
    other = DiskTier(tmp_path / "b", fingerprint({"model": "another"}), BS, HostBlockArrays(arrays), 1 << 20)
    with pytest.raises(ValueError, match="same fingerprint"):
        TierChain(disk_tier(tmp_path / "a", arrays), other)
    other.close()
