"""The KV tier counters of a bench run: the same figures from an engine's snapshots (offline
benchmarks) and from a server's `/metrics` page scraped before and after (serving benchmarks)."""

from __future__ import annotations

from bench.kv_tier_report import from_server_counters, from_tier_stats
from bench.report import print_result
from bench.serve import parse_counters
from bench.sweep import print_sweep
from jaxserve.engine_snapshot import EngineSnapshot
from jaxserve.kv import KVUsage
from jaxserve.kv.tier_stats import TierStats
from server.metrics import ServerMetrics

BEFORE = TierStats(
    device_hit_tokens=32,
    host_hit_tokens=16,
    disk_hit_tokens=0,
    disk_bytes_written=1000,
    disk_write_seconds=0.5,
    disk_written_blocks=2,
)
AFTER = TierStats(
    device_hit_tokens=96,
    host_hit_tokens=80,
    disk_hit_tokens=48,
    device_evictions=5,
    host_evictions=3,
    disk_evictions=1,
    disk_loads=2,
    disk_loaded_blocks=3,
    disk_load_seconds=0.25,
    disk_load_seconds_counts=(0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0),
    disk_bytes_read=3000,
    disk_bytes_written=5000,
    disk_written_blocks=10,
    disk_write_seconds=2.5,
    disk_damaged=1,
)


def _page(tiers: TierStats) -> str:
    usage = KVUsage(
        num_blocks=8,
        free=8,
        used=0,
        shared=0,
        cached=0,
        cached_idle=0,
        pinned=0,
        host_slots=0,
        host_swapped=0,
        host_cached=0,
        host_free=0,
    )
    snapshot = EngineSnapshot(
        running=0,
        waiting=0,
        swapped=0,
        preempted=0,
        has_unfinished=False,
        kv_requests=0,
        kv=usage,
        prefix_query_tokens=0,
        prefix_hit_tokens=0,
        num_preemptions=0,
        num_compilations=0,
        num_steps=0,
        prompt_tokens_computed=0,
        generated_tokens=0,
        replicas=(),
        tiers=tiers,
    )
    return ServerMetrics().render(snapshot, engine_alive=True).decode()


def test_offline_and_server_counters_give_the_same_report(capsys):
    offline = from_tier_stats(BEFORE, AFTER)
    assert offline == {
        "device_hit_tokens": 64,
        "host_hit_tokens": 16,
        "disk_hit_tokens": 48,  # disjoint: host excludes disk
        "pool_hit_tokens": 0,
        "device_evictions": 5,
        "host_evictions": 3,
        "disk_evictions": 1,
        "disk_bytes_read": 3000,
        "disk_bytes_written": 4000,
        "disk_loads": 2,
        "disk_mean_load_ms": 125.0,
        "disk_read_MB_per_s": 3000 / 0.25 / 1e6,
        "disk_write_MB_per_s": 4000 / 2.0 / 1e6,
        "disk_damaged_files": 1,
    }
    served = from_server_counters(parse_counters(_page(BEFORE)), parse_counters(_page(AFTER)))
    assert served == offline
    result = {
        "kind": "serve",
        "model": "m",
        "workload": {"name": "w"},
        "backends": {"jaxserve": {"results": {"completed": 1}, "kv_tiers": served}},
    }
    print_result(result)
    out = capsys.readouterr().out
    assert "jaxserve, KV tiers" in out and "disk_hit_tokens" in out and "125.00" in out
    points = [{"x": x, "results": {"completed": 1}, "kv_tiers": served} for x in (1, 2)]
    print_sweep(
        {"run": {"x": "max_concurrency"}, "backends": {"jaxserve": {"results": {}, "points": points}}}, ["completed"]
    )
    out = capsys.readouterr().out
    assert "sweep: jaxserve, KV tiers" in out and "max_concurrency=2" in out


def test_no_tier_counters_no_report():
    assert from_server_counters({}, {"vllm_requests_total": 3.0}) is None
    idle = from_tier_stats(AFTER, AFTER)
    assert idle["disk_mean_load_ms"] is None and idle["disk_read_MB_per_s"] is None
    assert not any(v for v in idle.values())


def test_disk_load_times_are_a_prometheus_histogram_summed_over_workers():
    lines = _page(AFTER).splitlines()
    name = "jaxserve_kv_disk_load_duration_seconds"
    assert f'{name}_bucket{{le="0.025"}} 0.0' in lines
    assert f'{name}_bucket{{le="0.05"}} 1.0' in lines and f'{name}_bucket{{le="0.1"}} 2.0' in lines
    assert f'{name}_bucket{{le="+Inf"}} 2.0' in lines
    assert f"{name}_count 2.0" in lines and f"{name}_sum 0.25" in lines
    # A remote worker's snapshot comes back from JSON with lists; the router sums them per bucket.
    from_json = TierStats(**{**AFTER.__dict__, "disk_load_seconds_counts": list(AFTER.disk_load_seconds_counts)})
    total = TierStats.total([from_json, AFTER])
    assert total.disk_load_seconds_counts == (0, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 0, 0, 0)
    assert total.disk_loads == 4 and total.minus(AFTER) == AFTER
