"""KV memory: block pool, prefix cache, block tables, leases, host tier and the tiers below it. No JAX here.

`KVCacheManager` is the entry point for the scheduler (its module docstring describes the API);
`build_kv_manager` builds one with its parts. A sequence's block table is a `KVHandle` that its
request owns. The declared interfaces: `PrefixCache` (radix_cache.RadixCache,
no_prefix_cache.NoPrefixCache), `SpillingPrefixCache` (RadixCache; what `TierLink` uses),
`KVTier` (disk_tier.DiskTier, pool_tier.PoolTier, tier_chain.TierChain over both; below the host
tier) and `LowerTierLink` (tier_link.TierLink, no_tier_link.NoTierLink; the cache's link to that tier).
"""

from jaxserve.kv.accounting import KVUsage
from jaxserve.kv.block_pool import RESERVED_BLOCK, BlockPool, NoFreeBlocksError
from jaxserve.kv.block_store import BlockStore
from jaxserve.kv.block_table import KVHandle
from jaxserve.kv.build import build_kv_manager
from jaxserve.kv.content_keys import ChainKeys, fingerprint
from jaxserve.kv.copy_plan import CopyKind, CopyPlan, CopyStage
from jaxserve.kv.disk_tier import DiskTier
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.kv_tier import HostBlockArrays, KVTier, KVTierStats
from jaxserve.kv.leases import Hold, Leases, Pin
from jaxserve.kv.manager import KVCacheManager
from jaxserve.kv.no_prefix_cache import NoPrefixCache
from jaxserve.kv.no_tier_link import NoTierLink
from jaxserve.kv.pool_tier import PoolTier
from jaxserve.kv.prefix_cache import CachedPath, CacheStats, PrefixCache, PrefixMatch, SpillingPrefixCache
from jaxserve.kv.prefix_hit import PrefixHit
from jaxserve.kv.radix_cache import RadixCache
from jaxserve.kv.tier_chain import TierChain
from jaxserve.kv.tier_link import LoadStart, LowerTierLink, TierLink

__all__ = [
    "RESERVED_BLOCK",
    "BlockPool",
    "NoFreeBlocksError",
    "BlockStore",
    "build_kv_manager",
    "ChainKeys",
    "fingerprint",
    "CopyKind",
    "CopyPlan",
    "CopyStage",
    "LoadStart",
    "DiskTier",
    "HostBlockArrays",
    "KVTier",
    "KVTierStats",
    "Hold",
    "HostTier",
    "KVCacheManager",
    "KVHandle",
    "KVUsage",
    "Leases",
    "PrefixHit",
    "Pin",
    "CacheStats",
    "CachedPath",
    "NoPrefixCache",
    "NoTierLink",
    "PoolTier",
    "LowerTierLink",
    "PrefixCache",
    "PrefixMatch",
    "RadixCache",
    "SpillingPrefixCache",
    "TierChain",
    "TierLink",
]
