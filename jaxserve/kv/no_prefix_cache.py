"""The prefix cache of an engine with prefix caching off: it caches nothing.

Every match is empty, every insert keeps nothing (the caller keeps its own blocks, uncached),
locks are no-ops, and device blocks and host slots come straight from the pool and the host tier.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from jaxserve.kv.block_pool import BlockPool
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.prefix_cache import CachedPath, CacheStats, InsertResult, PrefixMatch


class EmptyPath:
    """The one path of a cache that caches nothing."""

    __slots__ = ()

    @property
    def end(self) -> int:
        return 0


class NoPrefixCache:
    """A `PrefixCache` that stores no block."""

    def __init__(self, pool: BlockPool, host: HostTier) -> None:
        self.pool = pool
        self.host = host
        self.root = EmptyPath()
        self.stats = CacheStats()
        self._empty = PrefixMatch(self.root, [], 0, 0, pool.block_size)

    def match(self, tokens: Sequence[int] | np.ndarray, *, leave_last_token: bool = True) -> PrefixMatch:
        return self._empty

    def insert(self, tokens: Sequence[int] | np.ndarray, blocks: Sequence[int], *, parent: CachedPath) -> InsertResult:
        return InsertResult(self.root, [])

    def lock(self, path: CachedPath) -> None:
        pass

    def unlock(self, path: CachedPath) -> None:
        pass

    def path_blocks(self, path: CachedPath) -> list[int]:
        return []

    def device_prefix(self, path: CachedPath) -> CachedPath:
        return self.root

    def load_to_device(self, path: CachedPath) -> list[int]:
        return []

    def allocate(self, n: int) -> list[int]:
        return self.pool.allocate(n)

    def can_reserve_host(self, n: int) -> bool:
        return self.host.num_free >= n

    def reserve_host(self, n: int) -> list[int] | None:
        return self.host.allocate(n) if self.can_reserve_host(n) else None

    def evict(self, num_blocks: int) -> int:
        return 0

    @property
    def num_device_blocks(self) -> int:
        return 0

    @property
    def num_evictable_blocks(self) -> int:
        return 0

    @property
    def num_host_blocks(self) -> int:
        return 0

    def device_blocks(self) -> Iterator[int]:
        return iter(())

    def host_slots(self) -> Iterator[int]:
        return iter(())

    def check_integrity(self, direct_locks: Mapping[CachedPath, int]) -> None:
        if any(direct_locks.values()):
            raise AssertionError("a path of a cache that caches nothing is locked")
