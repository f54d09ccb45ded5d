"""Per-tier counters of the KV cache (device, host, and the lower tier: disk or pool), for snapshots,
`/metrics` and `bench`. The `disk_*` fields count the lower tier whichever it is (`lower_tier` names it;
/metrics publishes them as `kv_disk_*` or `kv_pool_*`)."""

from __future__ import annotations

import dataclasses

from jaxserve.kv.kv_tier import KV_LOAD_SECONDS_BUCKETS
from jaxserve.kv.manager import KVCacheManager


@dataclasses.dataclass(frozen=True)
class TierStats:
    device_hit_tokens: int = 0  # prompt tokens served from device blocks
    host_hit_tokens: int = 0  # ... copied back from the host tier (disk loads included)
    disk_hit_tokens: int = 0  # ... of which the lower tier (disk or pool) loaded
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
    lower_tier: str = ""  # the kind of the tier the disk_* fields count: "disk", "pool" or "" (none)

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

    @property
    def lower_tier_name(self) -> str:
        """What /metrics calls the lower tier: its kind, "disk" when there is none (all its counters 0)."""
        return self.lower_tier or "disk"

    def minus(self, before: TierStats) -> TierStats:
        """What the counters gained since `before` (gauges such as disk_files are differenced too)."""
        return TierStats(
            *(_combine([getattr(self, f.name), getattr(before, f.name)], -1) for f in dataclasses.fields(TierStats))
        )


def _combine(values: list, sign: int):
    """The first value plus (sign 1) or minus (sign -1) the others; tuples element by element; for a
    name (the lower tier's kind), the first one given (replicas of one engine share their settings)."""
    if isinstance(values[0], str):
        return next((v for v in values if v), "")
    if isinstance(values[0], tuple):
        return tuple(_combine(list(column), sign) for column in zip(*values))
    return values[0] + sign * sum(values[1:])
