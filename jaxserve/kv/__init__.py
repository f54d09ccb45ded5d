"""KV memory: block pool, prefix (radix) cache, block tables, leases, host and disk tiers. No JAX here.

`KVCacheManager` is the entry point for the scheduler; its module docstring describes the API.
A sequence's block table is a `KVHandle` that its request owns.
"""

from jaxserve.kv.accounting import KVUsage
from jaxserve.kv.block_pool import RESERVED_BLOCK, BlockPool, NoFreeBlocksError
from jaxserve.kv.block_table import KVHandle
from jaxserve.kv.content_keys import ChainKeys, fingerprint
from jaxserve.kv.copy_plan import CopyKind, CopyPlan, CopyStage
from jaxserve.kv.disk_link import LoadStart
from jaxserve.kv.disk_tier import DiskStats, DiskTier, HostBlockArrays
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.leases import Hold, Lease, Leases, Pin
from jaxserve.kv.manager import KVCacheManager
from jaxserve.kv.prefix_cache import PrefixCache, PrefixHit
from jaxserve.kv.radix_cache import RadixCache
from jaxserve.kv.radix_node import CacheStats, InsertResult, PrefixMatch, RadixNode

__all__ = [
    "RESERVED_BLOCK",
    "BlockPool",
    "NoFreeBlocksError",
    "ChainKeys",
    "fingerprint",
    "CopyKind",
    "CopyPlan",
    "CopyStage",
    "LoadStart",
    "DiskStats",
    "DiskTier",
    "HostBlockArrays",
    "Hold",
    "HostTier",
    "KVCacheManager",
    "KVHandle",
    "KVUsage",
    "Lease",
    "Leases",
    "PrefixHit",
    "Pin",
    "CacheStats",
    "InsertResult",
    "PrefixCache",
    "PrefixMatch",
    "RadixCache",
    "RadixNode",
]
