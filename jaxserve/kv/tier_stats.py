"""Per-tier counters of the KV cache (device, host, and the tiers below the host tier: disk and pool),
for snapshots, `/metrics` and `bench`. The `disk_*` fields count the disk tier, the `pool_*` fields
the pool tier (`lower_tiers` names those the engine has; /metrics publishes `kv_disk_*`, `kv_pool_*`)."""

from __future__ import annotations

import dataclasses

from jaxserve.kv.kv_tier import KV_LOAD_SECONDS_BUCKETS
from jaxserve.kv.manager import KVCacheManager

_NO_LOADS = (0,) * (len(KV_LOAD_SECONDS_BUCKETS) + 1)


@dataclasses.dataclass(frozen=True)
class TierStats:
    device_hit_tokens: int = 0  # prompt tokens served from device blocks
    host_hit_tokens: int = 0  # ... copied back from the host tier (disk and pool loads included)
    device_evictions: int = 0  # blocks evicted from the device (spilled or dropped)
    host_evictions: int = 0  # blocks dropped from the host tier
    # The disk tier. disk_hit_tokens: prompt tokens of host hits the disk tier loaded.
    disk_hit_tokens: int = 0
    disk_evictions: int = 0  # files deleted to stay within the disk budget
    disk_loads: int = 0  # load jobs finished
    disk_loaded_blocks: int = 0
    disk_load_seconds: float = 0.0  # summed wall time of the load jobs
    # the load jobs by wall time, one count per bucket of disk_tier.KV_LOAD_SECONDS_BUCKETS and one above them
    disk_load_seconds_counts: tuple[int, ...] = _NO_LOADS
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_written_blocks: int = 0
    disk_write_seconds: float = 0.0  # summed wall time of the file writes
    disk_damaged: int = 0  # damaged files found and deleted (recomputed, never served)
    disk_files: int = 0
    disk_bytes: int = 0
    # The pool tier, counted as the disk tier is (pool_files: the objects this engine knows the pool holds).
    pool_hit_tokens: int = 0
    pool_evictions: int = 0
    pool_loads: int = 0
    pool_loaded_blocks: int = 0
    pool_load_seconds: float = 0.0
    pool_load_seconds_counts: tuple[int, ...] = _NO_LOADS
    pool_bytes_read: int = 0
    pool_bytes_written: int = 0
    pool_written_blocks: int = 0
    pool_write_seconds: float = 0.0
    pool_damaged: int = 0
    pool_files: int = 0
    pool_bytes: int = 0
    lower_tiers: tuple[str, ...] = ()  # the kinds of the engine's tiers below the host tier, upper first

    def __post_init__(self) -> None:  # lists when read back from JSON (a remote worker's snapshot)
        for name in ("disk_load_seconds_counts", "pool_load_seconds_counts", "lower_tiers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

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
        return cls(*(_combine(f.name, [getattr(s, f.name) for s in stats], 1) for f in dataclasses.fields(cls)))

    @property
    def lower_tier_names(self) -> tuple[str, ...]:
        """The tiers below the host tier /metrics publishes: the engine's, the disk tier when it has none
        (all its counters 0)."""
        return self.lower_tiers or ("disk",)

    def minus(self, before: TierStats) -> TierStats:
        """What the counters gained since `before` (gauges such as disk_files are differenced too)."""
        return TierStats(
            *(
                _combine(f.name, [getattr(self, f.name), getattr(before, f.name)], -1)
                for f in dataclasses.fields(TierStats)
            )
        )


def _combine(name: str, values: list, sign: int):
    """The first value plus (sign 1) or minus (sign -1) the others; tuples element by element; for the
    tiers' kinds, the first ones given (replicas of one engine share their settings)."""
    if name == "lower_tiers":
        return next((v for v in values if v), ())
    if isinstance(values[0], tuple):
        return tuple(_combine(name, list(column), sign) for column in zip(*values))
    return values[0] + sign * sum(values[1:])
