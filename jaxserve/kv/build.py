"""Builds a KV manager with its parts: the block pool, the host tier, the prefix cache (radix, or
none when prefix caching is off) and the link to a tier below the host tier."""

from __future__ import annotations

from jaxserve.kv.block_pool import BlockPool
from jaxserve.kv.content_keys import PathSeeds, chain_keys
from jaxserve.kv.copy_plan import CopyPlan
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.kv_events import KVEventLog
from jaxserve.kv.kv_tier import KVTier
from jaxserve.kv.manager import KVCacheManager
from jaxserve.kv.no_prefix_cache import NoPrefixCache
from jaxserve.kv.no_tier_link import NoTierLink
from jaxserve.kv.prefix_cache import DroppedBlocks
from jaxserve.kv.radix_cache import RadixCache
from jaxserve.kv.state_slots import StateSlots
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
    lower_tier: KVTier | None = None,
    write_through_hits: int = 0,
    kv_events: bool = False,
    num_state_slots: int = 0,
    num_state_snapshots: int = 0,
    sliding_window: int | None = None,
) -> KVCacheManager:
    """
    num_blocks, block_size: the device pool (block 0 reserved).
    watermark_blocks, pin_budget_blocks, max_pinned_blocks: see `KVCacheManager`.
    enable_prefix_cache: a radix prefix cache, else one that caches nothing.
    num_host_slots: capacity of the host tier in blocks (0 = no swapping, no spilling).
    spill_to_host: blocks evicted from the device prefix cache move to the host tier.
    lower_tier: a tier under the host tier (the disk or the pool tier; needs the prefix cache and host slots).
    write_through_hits: 0 = write every cached block to it; N = once hit N times.
    kv_events: record the prefix cache's changes for a router (`manager.events`; needs the prefix cache).
    num_state_slots: a hybrid model's per-sequence state slots, slot 0 reserved (`state_slots.py`; 0: none).
    num_state_snapshots: of those, how many may keep snapshots for prefix hits (`state_snapshots.py`).
    sliding_window: a window-sized cache per sequence, for a model whose every layer slides (`window.py`).
    """
    pool = BlockPool(num_blocks, block_size)
    host = HostTier(num_host_slots)
    copies = CopyPlan()
    link: LowerTierLink = NoTierLink(block_size)
    if enable_prefix_cache:
        cache = RadixCache(pool, host, copies, spill_to_host=spill_to_host)
        if lower_tier is not None:
            link = TierLink(lower_tier, cache, host, copies, write_through_hits=write_through_hits)
    elif lower_tier is not None:
        raise ValueError("a tier below the host tier (disk or pool) needs the prefix cache")
    else:
        cache = NoPrefixCache(pool, host)
    return KVCacheManager(
        pool,
        cache,
        host,
        copies,
        events=_event_log(cache, link, block_size) if kv_events else None,
        watermark_blocks=watermark_blocks,
        pin_budget_blocks=pin_budget_blocks,
        max_pinned_blocks=max_pinned_blocks,
        tier_link=link,
        state_slots=StateSlots(num_state_slots),
        num_snapshots=num_state_snapshots,
        sliding_window=sliding_window,
    )


def _event_log(cache: RadixCache | NoPrefixCache, link: LowerTierLink, block_size: int) -> KVEventLog:
    """The log of the prefix cache's changes for a router (KV events)."""
    if not isinstance(cache, RadixCache):
        raise ValueError("KV events need the prefix cache")
    events = KVEventLog(link.new_chain().seed)
    _record_drops(cache, events, link.seeds, block_size)
    return events


def _record_drops(cache: RadixCache, events: KVEventLog, seeds: PathSeeds, block_size: int) -> None:
    """Blocks leaving the cache for good are recorded as removed (after the tier link's write-back)."""
    write_back = cache.on_drop

    def on_drop(dropped: DroppedBlocks) -> None:
        if write_back is not None:
            write_back(dropped)
        end = dropped.first + len(dropped.locations)
        seed = seeds.of(dropped.tokens)
        if seed is not None:  # else a LoRA path no request keyed: never recorded
            events.removed(chain_keys(seed, dropped.tokens, end, block_size)[dropped.first :])

    cache.on_drop = on_drop
