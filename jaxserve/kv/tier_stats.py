"""Per-tier counters of the KV cache (device, host, disk), for snapshots, `/metrics` and `bench`."""

from __future__ import annotations

import dataclasses

from jaxserve.kv.kv_tier import KV_LOAD_SECONDS_BUCKETS
from jaxserve.kv.manager import KVCacheManager


@dataclasses.dataclass(frozen=True)
class TierStats:
    device_hit_tokens: int = 0  # prompt tokens served from device blocks
    host_hit_tokens: int = 0  # ... copied back from the host tier (disk loads included)
    disk_hit_tokens: int = 0  # ... of which the disk tier loaded
    device_evictions: int = 0  # blocks evicted from the device (spilled or dropped)
    host_evictions: int = 0  # blocks dropped from the host tier
    disk_evictions: int = 0  # files deleted to stay within the disk budget
    disk_loads: int = 0  # load jobs finished
    disk_loaded_blocks: int = 0
    disk_load_seconds: float = 0.0  # summed wall time of the load jobs
    # the load jobs by wall time, one count per bucket of disk_tier.KV_LOAD_SECONDS_BUCKETS and one above them
    disk_load_seconds_counts: tuple[int, ...] = (0,) * (len(KV_LOAD_SECONDS_BUCKETS) + 1)
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_written_blocks: int = 0
    disk_write_seconds: float = 0.0  # summed wall time of the file writes
    disk_damaged: int = 0  # damaged files found and deleted (recomputed, never served)
    disk_files: int = 0
    disk_bytes: int = 0

    def __post_init__(self) -> None:  # a list when read back from JSON (a remote worker's snapshot)
        object.__setattr__(self, "disk_load_seconds_counts", tuple(self.disk_load_seconds_counts))

    @classmethod
    def of(cls, kv: KVCacheManager) -> TierStats:
        cache = kv.stats
        fields = dict(
            device_hit_tokens=cache.hit_tokens,
            host_hit_tokens=cache.host_hit_tokens,
            device_evictions=cache.device_evictions,
            host_evictions=cache.host_evictions,
        )
        fields.update(kv.tier_link.tier_stats())
        return cls(**fields)

    @classmethod
    def total(cls, stats: list[TierStats]) -> TierStats:
        return cls(*(_combine([getattr(s, f.name) for s in stats], 1) for f in dataclasses.fields(cls)))

    def minus(self, before: TierStats) -> TierStats:
        """What the counters gained since `before` (gauges such as disk_files are differenced too)."""
        return TierStats(
            *(_combine([getattr(self, f.name), getattr(before, f.name)], -1) for f in dataclasses.fields(TierStats))
        )


def _combine(values: list, sign: int):
    """The first value plus (sign 1) or minus (sign -1) the others; tuples element by element."""
    if isinstance(values[0], tuple):
        return tuple(_combine(list(column), sign) for column in zip(*values))
    return values[0] + sign * sum(values[1:])
