"""KV memory: block pool, prefix (radix) cache, block tables, host and disk tiers. No JAX here.

`KVCacheManager` is the entry point for the scheduler; its module docstring describes the API.
"""

from jaxserve.kv.block_pool import RESERVED_BLOCK, BlockPool, NoFreeBlocksError
from jaxserve.kv.content_keys import ChainKeys, fingerprint
from jaxserve.kv.copy_plan import CopyKind, CopyPlan, CopyStage
from jaxserve.kv.disk_link import LoadStart
from jaxserve.kv.disk_tier import DiskStats, DiskTier, HostBlockArrays
from jaxserve.kv.holds import Hold
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.manager import KVCacheManager, KVUsage, PrefixHit
from jaxserve.kv.pins import Pin, PinLedger
from jaxserve.kv.radix_cache import CacheStats, InsertResult, PrefixMatch, RadixCache, RadixNode

__all__ = [
    "RESERVED_BLOCK", "BlockPool", "NoFreeBlocksError", "ChainKeys", "fingerprint", "CopyKind", "CopyPlan",
    "CopyStage", "LoadStart", "DiskStats", "DiskTier", "HostBlockArrays",
    "Hold", "HostTier", "KVCacheManager", "KVUsage", "PrefixHit", "Pin", "PinLedger", "CacheStats",
    "InsertResult", "PrefixMatch", "RadixCache", "RadixNode",
]
