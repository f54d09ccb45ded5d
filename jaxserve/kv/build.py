"""Builds a KV manager with its parts: the block pool, the host tier, the prefix cache (radix, or
none when prefix caching is off) and the link to a tier below the host tier."""

from __future__ import annotations

from jaxserve.kv.block_pool import BlockPool
from jaxserve.kv.copy_plan import CopyPlan
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.kv_tier import KVTier
from jaxserve.kv.manager import KVCacheManager
from jaxserve.kv.no_prefix_cache import NoPrefixCache
from jaxserve.kv.no_tier_link import NoTierLink
from jaxserve.kv.radix_cache import RadixCache
from jaxserve.kv.tier_link import LowerTierLink, TierLink


def build_kv_manager(
    num_blocks: int,
    block_size: int = 16,
    *,
    watermark_blocks: int = 0,
    enable_prefix_cache: bool = True,
    num_host_slots: int = 0,
    spill_to_host: bool = True,
    pin_budget_blocks: int | None = None,
    max_pinned_blocks: int | None = None,
    disk: KVTier | None = None,
    disk_write_through_hits: int = 0,
) -> KVCacheManager:
    """
    num_blocks, block_size: the device pool (block 0 reserved).
    watermark_blocks, pin_budget_blocks, max_pinned_blocks: see `KVCacheManager`.
    enable_prefix_cache: a radix prefix cache, else one that caches nothing.
    num_host_slots: capacity of the host tier in blocks (0 = no swapping, no spilling).
    spill_to_host: blocks evicted from the device prefix cache move to the host tier.
    disk: a tier under the host tier (the disk tier; needs the prefix cache and host slots).
    disk_write_through_hits: 0 = write every cached block to it; N = once hit N times.
    """
    pool = BlockPool(num_blocks, block_size)
    host = HostTier(num_host_slots)
    copies = CopyPlan()
    link: LowerTierLink = NoTierLink(block_size)
    if enable_prefix_cache:
        cache = RadixCache(pool, host, copies, spill_to_host=spill_to_host)
        if disk is not None:
            link = TierLink(disk, cache, host, copies, write_through_hits=disk_write_through_hits)
    elif disk is not None:
        raise ValueError("the disk tier needs the prefix cache")
    else:
        cache = NoPrefixCache(pool, host)
    return KVCacheManager(
        pool,
        cache,
        host,
        copies,
        watermark_blocks=watermark_blocks,
        pin_budget_blocks=pin_budget_blocks,
        max_pinned_blocks=max_pinned_blocks,
        tier_link=link,
    )
