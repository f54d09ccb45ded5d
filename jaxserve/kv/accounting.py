"""Accounting and checks of a KV manager: block counts for metrics, and the invariants tests check
after every operation (a block is free xor referenced; refcounts equal the tables and cache
entries holding the block; lock counts equal their holders; nothing leaks)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.kv.block_pool import RESERVED_BLOCK
from jaxserve.kv.block_table import KVHandle
from jaxserve.kv.prefix_cache import CachedPath, PrefixCache

if TYPE_CHECKING:
    from jaxserve.kv.manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class KVUsage:
    """Block counts. free + used + pinned + cached_idle == num_blocks (each block once)."""

    num_blocks: int  # usable device blocks (the reserved block 0 excluded)
    free: int  # on the free list
    used: int  # held by at least one request (or locked by one: cached blocks out of its sliding window)
    shared: int  # held by two or more requests
    cached: int  # stored in the prefix cache (some may also be used or pinned)
    cached_idle: int  # cached and held by no request or pin: reclaimable at once
    pinned: int  # cached, held by no request, kept by a pin
    host_slots: int
    host_swapped: int  # host slots holding swapped-out requests
    host_cached: int  # host slots holding spilled prefix-cache blocks
    host_free: int

    @property
    def available(self) -> int:
        """Blocks an allocation can get: free now or by evicting idle cache."""
        return self.free + self.cached_idle

    @classmethod
    def total(cls, usages: list[KVUsage]) -> KVUsage:
        """Field-by-field sums (the pools of several data-parallel replicas)."""
        return cls(*(sum(getattr(u, f.name) for u in usages) for f in fields(cls)))


def kv_usage(mgr: KVCacheManager) -> KVUsage:
    """Block counts of a KV manager; O(blocks), so call it per scrape, not per step."""
    holders = np.zeros(mgr.pool.num_blocks, dtype=np.int32)
    cache, host = mgr.prefix_cache, mgr.host
    for handle in mgr.live_handles():
        np.add.at(holders, handle.held_blocks, 1)
        if handle.num_dropped and handle.cached_blocks:  # its cached blocks the window dropped: still locked by it
            np.add.at(holders, cache.path_blocks(handle.path)[: handle.num_dropped], 1)
    swapped = sum(len(h.host_slots) for h in mgr.live_handles() if h.host_slots is not None)
    cached_blocks = np.fromiter(cache.device_blocks(), dtype=np.int64)
    cached_used = int((holders[cached_blocks] > 0).sum())
    return KVUsage(
        num_blocks=mgr.pool.num_usable,
        free=mgr.pool.num_free,
        used=int((holders > 0).sum()),
        shared=int((holders > 1).sum()),
        cached=cache.num_device_blocks,
        cached_idle=cache.num_evictable_blocks,
        pinned=cache.num_device_blocks - cache.num_evictable_blocks - cached_used,
        host_slots=host.num_host_slots,
        host_swapped=swapped,
        host_cached=cache.num_host_blocks,
        host_free=host.num_free,
    )


def check_integrity(mgr: KVCacheManager) -> None:
    """Check the invariants of a KV manager's pool, tables, cache, host tier and leases (AssertionError)."""
    cache = mgr.prefix_cache
    holders: Counter[int] = Counter(cache.device_blocks())
    locks: Counter[CachedPath] = Counter(mgr.leases.locked_paths())
    host_held = list(cache.host_slots())
    for handle in mgr.live_handles():
        if not handle.is_live:
            raise AssertionError("a freed handle among the live ones")
        if handle.host_slots is not None:
            _check_swapped(handle, mgr.block_size)
            host_held += handle.host_slots
        else:
            holders.update(_check_on_device(handle, cache))
            locks[handle.path] += 1
    locks.update(mgr.tier_link.locked_paths())
    host_held += mgr.tier_link.held_host_slots()
    mgr.tier_link.check_integrity()
    del locks[cache.root]
    cache.check_integrity(locks)
    pool = mgr.pool
    pool.check_integrity([holders.get(block, 0) for block in range(pool.num_blocks)])
    mgr.host.check_integrity(host_held)
    mgr.leases.check_integrity()
    held = [h.state_slot for h in mgr.live_handles() if h.state_slot is not None]
    mgr.state_slots.check_integrity(held + mgr.snapshots.held_slots())


def _check_swapped(handle: KVHandle, block_size: int) -> None:
    if handle.num_blocks or len(handle.host_slots) != -(-handle.num_tokens // block_size) - handle.num_dropped:
        raise AssertionError("a swapped sequence's host slots do not cover its tokens")


def _check_on_device(handle: KVHandle, cache: PrefixCache) -> list[int]:
    """Check a running sequence's table against its tokens and the cache; returns the blocks it holds
    (its dropped entries, out of a sliding window, are the reserved block)."""
    table, dropped = handle.table[: handle.num_blocks].tolist(), handle.num_dropped
    blocks = table[dropped:]
    if len(table) != -(-handle.num_tokens // handle.block_size):
        raise AssertionError(f"a sequence has {len(table)} blocks for {handle.num_tokens} tokens")
    if len(set(blocks)) != len(blocks) or RESERVED_BLOCK in blocks or set(table[:dropped]) - {RESERVED_BLOCK}:
        raise AssertionError("repeated or reserved block in a table, or a dropped entry not the reserved block")
    if handle.path.end != handle.cached_blocks or dropped >= handle.cached_blocks > 0:
        raise AssertionError(
            f"a sequence's locked path ends at block {handle.path.end}, cached_blocks {handle.cached_blocks}, "
            f"{dropped} dropped"
        )
    if cache.path_blocks(handle.path)[dropped:] != table[dropped : handle.cached_blocks]:
        raise AssertionError("a sequence's cached blocks differ from the cache")
    return blocks
