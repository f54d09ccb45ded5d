"""The disk tier and the pool tier together in the engine (tiny random model, a real Mooncake Store
master on loopback): a prefix an engine computed is a disk hit after it restarts on its directory
and a pool hit for an engine on another directory, with the tokens of a cold run and the hits
counted per tier; with the master dead, the disk still serves and requests go on."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from tier_engines import GREEDY, random_prompts, run, tier_llm

from jaxserve import LLM
from jaxserve.engine_args import add_engine_args, engine_config_from_args
from jaxserve.kv import TierChain
from server.cluster.launch.mooncake_master import PoolMaster, mooncake_missing
from server.metrics import ServerMetrics

if (why := mooncake_missing()) is not None:
    pytest.skip(why, allow_module_level=True)

PROMPTS = random_prompts(150, 97)
FULL_BLOCKS = 144 + 96  # the prompts' full blocks; the last prompt token is always computed


def make(disk_dir=None, pool: str | None = None) -> LLM:
    tiers = {"kv_disk_dir": str(disk_dir)} if disk_dir is not None else {}
    tiers.update({"kv_pool": pool} if pool else {})
    return tier_llm(kv_disk_bytes=64 << 20, kv_pool_segment_bytes=32 << 20, **tiers)


def close(llm: LLM, assert_kv_all_free) -> None:
    assert_kv_all_free(llm.engine)
    assert not llm.engine.kv.loads.pending and not llm.engine.kv.tier_link.held_host_slots()
    llm.close()  # writes what either tier lacks of the prefix cache, then waits for the writes


@pytest.fixture(scope="module")
def reference():
    return run(make(), PROMPTS)[0]


def test_another_engine_hits_the_pool_and_a_restart_hits_the_disk(tmp_path, master, reference, assert_kv_all_free):
    a = make(tmp_path / "a", master.url)
    assert isinstance(a.engine.lower_tier, TierChain)
    assert run(a, PROMPTS)[0] == reference
    a.engine.step()  # the last planned writes
    a.engine.lower_tier.flush()
    tiers = a.engine.snapshot().tiers
    assert tiers.lower_tiers == ("disk", "pool")
    assert tiers.disk_written_blocks >= FULL_BLOCKS // 8 and tiers.pool_written_blocks >= FULL_BLOCKS // 8

    # Another directory, the same pool (whose objects live in the memory engine a lends it: a runs on).
    b = make(tmp_path / "b", master.url)
    assert run(b, PROMPTS) == (reference, [144, 96])
    snapshot = b.engine.snapshot()
    tiers = snapshot.tiers
    assert tiers.pool_hit_tokens == FULL_BLOCKS and tiers.pool_loads >= 1 and tiers.pool_bytes_read > 0
    assert tiers.disk_hit_tokens == 0 and tiers.disk_loads == 0
    assert b.engine.stats.prompt_tokens_computed < 150 + 97 - 200
    text = ServerMetrics().render(snapshot, True).decode()  # each tier's counters under its own name
    assert f'jaxserve_kv_tier_hit_tokens_total{{tier="pool"}} {float(FULL_BLOCKS)}' in text
    assert 'jaxserve_kv_tier_hit_tokens_total{tier="disk"} 0.0' in text
    assert f'jaxserve_kv_pool_io_bytes_total{{direction="read"}} {float(tiers.pool_bytes_read)}' in text
    assert "jaxserve_kv_disk_load_duration_seconds_count 0.0" in text
    close(b, assert_kv_all_free)
    assert b.engine.snapshot().tiers.disk_files >= FULL_BLOCKS // 8  # its close kept the pool's blocks on its disk
    close(a, assert_kv_all_free)

    restarted = make(tmp_path / "a", master.url)  # a's directory: its blocks come from its disk
    assert run(restarted, PROMPTS) == (reference, [144, 96])
    tiers = restarted.engine.snapshot().tiers
    assert tiers.disk_hit_tokens == FULL_BLOCKS and tiers.disk_loads >= 1
    assert tiers.pool_hit_tokens == 0 and tiers.pool_loads == 0
    close(restarted, assert_kv_all_free)


def test_with_the_master_dead_the_disk_serves_and_requests_go_on(tmp_path, reference, assert_kv_all_free):
    m = PoolMaster()
    m.start()
    try:
        a, b = make(tmp_path, m.url), make(tmp_path, m.url)  # one directory, both started before any write
        assert run(a, PROMPTS)[0] == reference
        close(a, assert_kv_all_free)  # its blocks on the disk (and in the pool, until it leaves it)
        m.kill()
        more = [np.random.default_rng(10 + i).integers(3, 250, 60).tolist() for i in range(3)]
        tokens, _ = run(b, more)  # new prompts: the pool is asked, found down; computed, written to the disk
        assert all(len(t) == GREEDY.max_tokens for t in tokens)
        pool = b.engine.lower_tier.lower
        assert not pool.is_up and pool.stats.outages == 1
        assert run(b, PROMPTS) == (reference, [144, 96])  # the pool down, the disk serves: b finds a's files
        tiers = b.engine.snapshot().tiers
        assert tiers.disk_hit_tokens == FULL_BLOCKS and tiers.pool_hit_tokens == 0 and tiers.pool_loads == 0
        b.engine.step()
        b.engine.lower_tier.flush()
        assert b.engine.snapshot().tiers.disk_files >= (FULL_BLOCKS + 3 * 56) // 8  # b's new blocks too
        close(b, assert_kv_all_free)
    finally:
        m.kill()


def test_both_tiers_from_the_command_line():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-disk-dir", "/tmp/kv", "--kv-pool", "mooncake://127.0.0.1:50051"])
    config = engine_config_from_args(args)  # checked as the engine's config: once refused
    assert config.kv_disk_dir == "/tmp/kv" and config.kv_pool == "mooncake://127.0.0.1:50051"
