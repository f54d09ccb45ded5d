"""Per-tier counters of the KV cache (device, host, disk), for snapshots, `/metrics` and `bench`."""

from __future__ import annotations

import dataclasses

from jaxserve.kv.manager import KVCacheManager


@dataclasses.dataclass(frozen=True)
class TierStats:
    device_hit_tokens: int = 0      # prompt tokens served from device blocks
    host_hit_tokens: int = 0        # ... copied back from the host tier (disk loads included)
    disk_hit_tokens: int = 0        # ... of which the disk tier loaded
    device_evictions: int = 0       # blocks evicted from the device (spilled or dropped)
    host_evictions: int = 0         # blocks dropped from the host tier
    disk_evictions: int = 0         # files deleted to stay within the disk budget
    disk_loads: int = 0             # load jobs finished
    disk_loaded_blocks: int = 0
    disk_load_seconds: float = 0.0  # summed wall time of the load jobs
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_written_blocks: int = 0
    disk_write_seconds: float = 0.0  # summed wall time of the file writes
    disk_damaged: int = 0           # damaged files found and deleted (recomputed, never served)
    disk_files: int = 0
    disk_bytes: int = 0

    @classmethod
    def of(cls, kv: KVCacheManager) -> TierStats:
        cache = kv.stats
        fields = dict(device_hit_tokens=cache.hit_tokens, host_hit_tokens=cache.host_hit_tokens,
                      device_evictions=cache.device_evictions, host_evictions=cache.host_evictions)
        if kv.disk is not None:
            disk = kv.disk.disk
            s = disk.stats
            fields.update(disk_hit_tokens=kv.disk.disk_hit_tokens, disk_evictions=s.evictions, disk_loads=s.loads,
                          disk_loaded_blocks=s.loaded_blocks, disk_load_seconds=s.load_seconds,
                          disk_bytes_read=s.bytes_read, disk_bytes_written=s.bytes_written,
                          disk_written_blocks=s.written_blocks, disk_write_seconds=s.write_seconds, disk_damaged=s.damaged, disk_files=disk.num_files,
                          disk_bytes=disk.num_bytes)
        return cls(**fields)

    @classmethod
    def total(cls, stats: list[TierStats]) -> TierStats:
        return cls(*(sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(cls)))
