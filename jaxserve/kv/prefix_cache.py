"""The interface of a prefix cache (what the KV manager and the leases ask of one), and the
manager's answer to "what of this prompt is cached" (`PrefixHit`).

`RadixCache` (radix_cache.py) is the implementation. The callers hold nodes (`RadixNode`) only as
opaque handles to a matched or inserted path: they lock a path while they use its blocks and unlock
it when they are done; everything else about the tree, its tiers and its eviction order stays
behind these methods. The disk tier's link (disk_link.py) works below this interface, on the
radix cache itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from jaxserve.kv.content_keys import ChainKeys
from jaxserve.kv.radix_node import CacheStats, InsertResult, PrefixMatch, RadixNode


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached prefix of a prompt, from `match_prefix`; pass it to `admit`."""

    num_tokens: int  # prompt tokens whose KV is cached (device + host)
    num_host_tokens: int  # the part of num_tokens that is copied back from the host tier
    num_prompt_tokens: int
    _node: RadixNode | None
    _device_blocks: list[int]
    _idle_path_blocks: int
    _epoch: int
    num_disk_tokens: int = 0  # after num_tokens: blocks on the disk tier (see `DiskLoads.start`)
    _chain: ChainKeys | None = None
    _token_ids: Sequence[int] | np.ndarray | None = None


@runtime_checkable
class PrefixCache(Protocol):
    root: RadixNode  # the empty path: a handle that locks nothing
    stats: CacheStats

    def match(self, tokens: Sequence[int] | np.ndarray, *, leave_last_token: bool = True) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole blocks (nothing locked)."""

    def insert(
        self, tokens: Sequence[int] | np.ndarray, blocks: Sequence[int], *, parent: RadixNode | None = None
    ) -> InsertResult:
        """Cache full blocks of computed KV after `parent`'s path and lock the result for the caller."""

    def lock(self, node: RadixNode) -> None:
        """Keep the path ending at `node` from eviction."""

    def unlock(self, node: RadixNode) -> None:
        """Release one `lock` (or the lock an `insert` took)."""

    def path_blocks(self, node: RadixNode) -> list[int]:
        """The device blocks of the path ending at `node`."""

    def load_to_device(self, node: RadixNode) -> list[int]:
        """Bring the host part of a locked path back to the device (plans the copies)."""

    def allocate(self, n: int) -> list[int]:
        """n free device blocks, evicting idle cached ones if the free list is short."""

    def can_reserve_host(self, n: int) -> bool:
        """Whether n host slots can be had (free, or by evicting idle cached host blocks)."""

    def reserve_host(self, n: int) -> list[int] | None:
        """n host slots (evicting idle cached host blocks as needed), or None."""

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` idle device blocks (spilled to the host tier or dropped)."""

    def clear(self) -> int:
        """Drop every idle cached block; returns the device blocks freed."""

    @property
    def num_device_blocks(self) -> int:
        """Device blocks the cache stores."""

    @property
    def num_evictable_blocks(self) -> int:
        """Device blocks no one locks: what `allocate` may evict."""

    # What the KV accounting reads (`accounting.kv_usage`, `accounting.check_integrity`).

    @property
    def num_host_blocks(self) -> int:
        """Host slots holding spilled cached blocks."""

    def device_blocks(self) -> Iterator[int]:
        """Every device block the cache stores."""

    def host_slots(self) -> Iterator[int]:
        """Every host slot the cache stores."""

    def check_integrity(self, direct_locks: dict[RadixNode, int] | None = None) -> None:
        """Raise AssertionError unless the cache is consistent (and its locks match `direct_locks`)."""
