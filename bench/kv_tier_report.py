"""KV tier counters of one benchmark run: prompt tokens each tier served, evictions per tier, and the
disk tier's bytes, loads and latency. The same keys whether they come from an engine in this process
(`TierStats` before and after, `bench throughput` / `latency`) or from a server's `/metrics` scraped
before and after (`bench serve` / `sweep`).

Unlike the engine's `host_hit_tokens` (which includes what the disk and the pool loaded into the host
tier), here the hit counts are disjoint: device + host + disk + pool = all cached prompt tokens. (The
pool's hits only: its bytes and loads are in `bench.kv_pool`'s report.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxserve.kv.tier_stats import TierStats

PREFIX = "jaxserve"  # the server's metric prefix (server/metrics.py)


def _summary(
    hits: tuple[float, float, float, float],
    evictions: tuple[float, float, float],
    bytes_read: float,
    bytes_written: float,
    loads: float,
    load_seconds: float,
    write_seconds: float,
    damaged: float,
) -> dict[str, Any]:
    device, host_with_lower, disk, pool = hits
    return {
        "device_hit_tokens": int(device),
        "host_hit_tokens": int(host_with_lower - disk - pool),
        "disk_hit_tokens": int(disk),
        "pool_hit_tokens": int(pool),
        "device_evictions": int(evictions[0]),
        "host_evictions": int(evictions[1]),
        "disk_evictions": int(evictions[2]),
        "disk_bytes_read": int(bytes_read),
        "disk_bytes_written": int(bytes_written),
        "disk_loads": int(loads),
        "disk_mean_load_ms": load_seconds / loads * 1e3 if loads else None,
        # over the loader's and writer's busy time, not the run's: what the files moved at
        "disk_read_MB_per_s": bytes_read / load_seconds / 1e6 if load_seconds else None,
        "disk_write_MB_per_s": bytes_written / write_seconds / 1e6 if write_seconds else None,
        "disk_damaged_files": int(damaged),
    }


def from_tier_stats(before: TierStats, after: TierStats) -> dict[str, Any]:
    """The run's counters from an engine's `snapshot().tiers` taken before and after it."""
    d = after.minus(before)
    return _summary(
        (d.device_hit_tokens, d.host_hit_tokens, d.disk_hit_tokens, d.pool_hit_tokens),
        (d.device_evictions, d.host_evictions, d.disk_evictions),
        d.disk_bytes_read,
        d.disk_bytes_written,
        d.disk_loads,
        d.disk_load_seconds,
        d.disk_write_seconds,
        d.disk_damaged,
    )


def from_server_counters(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any] | None:
    """The run's counters from two scrapes of a server's `/metrics` counters (`bench.serve.scrape_counters`);
    None when the server has no tier counters (a peer, or a jaxserve from before them)."""
    if not any(name.startswith(f"{PREFIX}_kv_tier_hit_tokens_total") for name in after):
        return None

    def delta(name: str, label: str = "", suffix: str = "_total") -> float:
        key = f"{PREFIX}_{name}{suffix}" + (f"{{{label}}}" if label else "")
        return after.get(key, 0.0) - before.get(key, 0.0)

    tiers = ("device", "host", "disk")
    return _summary(
        tuple(delta("kv_tier_hit_tokens", f"tier={t}") for t in (*tiers, "pool")),
        tuple(delta("kv_tier_evictions", f"tier={t}") for t in tiers),
        delta("kv_disk_io_bytes", "direction=read"),
        delta("kv_disk_io_bytes", "direction=written"),
        delta("kv_disk_load_duration_seconds", suffix="_count"),
        delta("kv_disk_load_duration_seconds", suffix="_sum"),
        delta("kv_disk_write_seconds"),
        delta("kv_disk_damaged_files"),
    )
