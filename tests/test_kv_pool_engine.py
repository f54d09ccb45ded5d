"""The pool tier in the engine (tiny random model, a real Mooncake Store master on loopback): a
second engine reads from the pool what the first computed and answers the same tokens; with the
master dead, requests go on (recomputed) and nothing fails; DeepSeek-V3's latent blocks go
through the pool as K/V blocks do."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tier_engines import GREEDY, random_prompts, run, tier_llm

from jaxserve import LLM
from server.cluster.launch.mooncake_master import PoolMaster, mooncake_missing
from server.metrics import ServerMetrics

if (why := mooncake_missing()) is not None:
    pytest.skip(why, allow_module_level=True)

PROMPTS = random_prompts(150, 97)


def make(pool: str | None, family: str = "llama") -> LLM:
    return tier_llm(family, kv_pool_segment_bytes=32 << 20, **({"kv_pool": pool} if pool else {}))


def close(llm: LLM, assert_kv_all_free) -> None:
    assert_kv_all_free(llm.engine)
    assert not llm.engine.kv.loads.pending and not llm.engine.kv.tier_link.held_host_slots()
    llm.close()


@pytest.fixture(scope="module")
def reference():
    return run(make(None), PROMPTS)[0]


def test_a_second_engine_reads_the_prefix_from_the_pool(master, reference, assert_kv_all_free):
    a, b = make(master.url), make(master.url)
    assert run(a, PROMPTS)[0] == reference
    a.engine.step()  # the last planned writes
    a.engine.lower_tier.flush()
    assert a.engine.snapshot().tiers.pool_written_blocks >= (150 + 97) // 8
    tokens, cached = run(b, PROMPTS)
    assert tokens == reference
    assert cached == [144, 96]  # full blocks from the pool, the last prompt token computed
    snapshot = b.engine.snapshot()
    tiers = snapshot.tiers
    assert tiers.pool_hit_tokens >= 144 + 96 and tiers.pool_loads >= 1 and tiers.lower_tiers == ("pool",)
    assert b.engine.stats.prompt_tokens_computed < 150 + 97 - 200
    # /metrics names the pool's counters as the pool's, not the disk tier's
    text = ServerMetrics().render(snapshot, True).decode()
    assert f'jaxserve_kv_tier_hit_tokens_total{{tier="pool"}} {float(tiers.pool_hit_tokens)}' in text
    assert f'jaxserve_kv_pool_io_bytes_total{{direction="read"}} {float(tiers.pool_bytes_read)}' in text
    assert "jaxserve_kv_pool_load_duration_seconds_count" in text and "jaxserve_kv_disk_" not in text
    close(a, assert_kv_all_free)
    close(b, assert_kv_all_free)


def test_latent_blocks_of_deepseek_v3_go_through_the_pool(master, assert_kv_all_free):
    """A latent cache (one latent per token, no heads) is written to and read from the pool too."""
    want = run(make(None, "deepseek_v3"), PROMPTS)[0]
    a, b = make(master.url, "deepseek_v3"), make(master.url, "deepseek_v3")
    assert run(a, PROMPTS)[0] == want
    a.engine.step()
    a.engine.lower_tier.flush()
    tokens, cached = run(b, PROMPTS)
    assert tokens == want and cached == [144, 96]
    close(a, assert_kv_all_free)
    close(b, assert_kv_all_free)


def test_a_master_killed_under_load_fails_no_request_and_a_restarted_one_is_used(reference, assert_kv_all_free):
    m = PoolMaster()
    m.start()
    try:
        llm = make(m.url)
        tier = llm.engine.lower_tier
        prompts = [np.random.default_rng(100 + i).integers(3, 250, 120).tolist() for i in range(12)]
        with ThreadPoolExecutor(1) as pool:  # the master dies while these run
            running = pool.submit(run, llm, prompts)
            deadline = time.monotonic() + 60
            while tier.stats.written_blocks == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            m.kill()
            outputs = running.result(timeout=600)[0]
        assert len(outputs) == len(prompts) and all(len(o) == GREEDY.max_tokens for o in outputs)
        tokens, cached = run(llm, PROMPTS)
        assert tokens == reference and not tier.is_up and tier.stats.outages == 1
        m.start()  # a new master, empty: the tier comes back and is written to again
        deadline = time.monotonic() + 60
        while not tier.is_up and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tier.is_up
        written = tier.stats.written_blocks
        deadline = time.monotonic() + 60
        seed = 200
        while tier.stats.written_blocks == written and time.monotonic() < deadline:  # the client re-joins
            run(llm, [np.random.default_rng(seed + i).integers(3, 250, 64).tolist() for i in range(2)])
            llm.engine.step()
            tier.flush()
            seed += 2  # new prompts: new blocks to write
        assert tier.stats.written_blocks > written
        close(llm, assert_kv_all_free)
    finally:
        m.kill()


def test_a_bad_pool_url_is_refused():
    with pytest.raises(ValueError, match="mooncake://HOST:PORT"):
        make("mooncake://nohost")
