"""The interface of a prefix cache: what the KV manager and the leases ask of one.

Two implementations: `RadixCache` (radix_cache.py: a radix tree of full blocks, spilling to the
host tier) and `NoPrefixCache` (no_prefix_cache.py: prefix caching off, caches nothing). Whoever
builds the KV manager picks one (`build.build_kv_manager`); the manager never asks which it has.

Callers hold paths (`CachedPath`) only as opaque handles to a matched or inserted path: they lock
a path while they use its blocks and unlock it when they are done; the tree, its tiers and its
eviction order stay behind these methods. The link to the tiers below the host tier
(`tier_link.py`) asks a little more of a cache that spills to the host: `SpillingPrefixCache`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


class CachedPath(Protocol):
    """An opaque handle to a cached path, from the first block on. Its one public fact is its length."""

    @property
    def end(self) -> int:
        """Blocks on the path."""


@dataclass
class CacheStats:
    """Hit statistics, recorded when a match is used (admission), not on every peek."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0  # served from device blocks
    host_hit_tokens: int = 0  # served from the host tier (copied back, not recomputed)
    device_evictions: int = 0  # blocks evicted from the device (spilled to the host or dropped)
    host_evictions: int = 0  # blocks dropped from the host tier

    def record(self, query_tokens: int, hit_tokens: int, host_hit_tokens: int) -> None:
        self.queries += 1
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
        self.host_hit_tokens += host_hit_tokens


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix of a token sequence."""

    path: CachedPath  # the matched path (the empty one when nothing matched)
    device_blocks: list[int]  # device blocks of the matched path, in order
    num_host_blocks: int  # blocks after those that live on the host tier
    idle_device_blocks: int  # device blocks on the path no one holds: locking removes them
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.device_blocks) + self.num_host_blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_host_tokens(self) -> int:
        return self.num_host_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class InsertResult:
    path: CachedPath  # the inserted path, locked once for the caller
    blocks: list[int]  # the cache's blocks for the inserted positions (may differ from yours, or be fewer)


@runtime_checkable
class PrefixCache(Protocol):
    root: CachedPath  # the empty path: a handle that locks nothing
    stats: CacheStats

    def match(self, tokens: Sequence[int] | np.ndarray, *, leave_last_token: bool = True) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole blocks (nothing locked)."""

    def insert(self, tokens: Sequence[int] | np.ndarray, blocks: Sequence[int], *, parent: CachedPath) -> InsertResult:
        """Cache full blocks of computed KV after `parent`'s path and lock the result for the caller."""

    def lock(self, path: CachedPath) -> None:
        """Keep `path` from eviction."""

    def unlock(self, path: CachedPath) -> None:
        """Release one `lock` (or the lock an `insert` took)."""

    def path_blocks(self, path: CachedPath) -> list[int]:
        """The device blocks of a path that is all on the device."""

    def device_prefix(self, path: CachedPath) -> CachedPath:
        """The longest leading part of `path` that is on the device (its host part left out)."""

    def load_to_device(self, path: CachedPath) -> list[int]:
        """Bring the host part of a locked path back to the device (plans the copies)."""

    def allocate(self, n: int) -> list[int]:
        """n free device blocks, evicting idle cached ones if the free list is short."""

    def can_reserve_host(self, n: int) -> bool:
        """Whether n host slots can be had (free, or by evicting idle cached host blocks)."""

    def reserve_host(self, n: int) -> list[int] | None:
        """n host slots (evicting idle cached host blocks as needed), or None."""

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` idle device blocks (spilled to the host tier or dropped)."""

    @property
    def num_device_blocks(self) -> int:
        """Device blocks the cache stores."""

    @property
    def num_evictable_blocks(self) -> int:
        """Device blocks no one locks: what `allocate` may evict."""

    @property
    def num_host_blocks(self) -> int:
        """Host slots holding spilled cached blocks."""

    # What the KV accounting reads (`accounting.kv_usage`, `accounting.check_integrity`).

    def device_blocks(self) -> Iterator[int]:
        """Every device block the cache stores."""

    def host_slots(self) -> Iterator[int]:
        """Every host slot the cache stores."""

    def check_integrity(self, direct_locks: Mapping[CachedPath, int]) -> None:
        """Raise AssertionError unless the cache is consistent and its locks match `direct_locks`
        (each locked path's number of holders; the empty path left out)."""


@dataclass(frozen=True, slots=True)
class CachedRun:
    """A run of cached blocks that continues a path: what a spilling cache reports of its contents."""

    path: CachedPath  # the path that ends with this run
    parent: CachedPath  # the path it continues
    tokens: bytes  # the run's token ids (int32 bytes)
    locations: list[int]  # its device blocks, or its host slots
    on_device: bool


@dataclass(frozen=True, slots=True)
class DroppedBlocks:
    """Cached blocks about to leave the cache for good: blocks [first, first + len(locations)) of a
    path whose token ids (from the first block up to the dropped ones' end) are `tokens`."""

    tokens: np.ndarray
    first: int
    locations: list[int]  # device blocks, or host slots
    on_device: bool


@runtime_checkable
class SpillingPrefixCache(PrefixCache, Protocol):
    """A prefix cache that spills to the host tier: what the link to the lower tiers uses."""

    block_size: int
    # Called just before cached blocks leave the cache (dropped from the device without a host
    # host slot, or from the host): the lower tiers' write-back.
    on_drop: Callable[[DroppedBlocks], None] | None

    @property
    def num_evictable_host_blocks(self) -> int:
        """Host slots of idle cached blocks: what `reserve_host` may evict."""

    def insert_host(self, parent: CachedPath, tokens: bytes, host_slots: list[int]) -> tuple[CachedPath, list[int]]:
        """Add blocks read into host slots after `parent` (locked by the caller); returns the
        path (not locked) and the host slots not taken (positions cached meanwhile)."""

    def runs_by_recency(self) -> Iterator[CachedRun]:
        """Every cached run, most recently used first, never before the run it continues."""
