"""The nodes of the radix prefix cache (`radix_cache.py`) and what its lookups return."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TOKEN_BYTES = 4
assert array("i").itemsize == TOKEN_BYTES


def token_bytes(tokens: Sequence[int] | np.ndarray, num_tokens: int) -> bytes:
    """The first `num_tokens` token ids as int32 bytes: the key format of the tree."""
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens[:num_tokens], dtype=np.int32).tobytes()
    return array("i", tokens[:num_tokens]).tobytes()


class RadixNode:
    """One run of blocks in the tree. Opaque to users: hold it to unlock what you locked."""

    __slots__ = ("parent", "children", "key", "start", "length", "blocks", "host_slots", "lock")

    def __init__(
        self,
        parent: RadixNode | None,
        key: bytes,
        start: int,
        length: int,
        blocks: list[int] | None,
        host_slots: list[int] | None,
        lock: int = 0,
    ) -> None:
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.key = key
        self.start = start  # blocks on the path before this node
        self.length = length  # blocks in this node
        self.blocks = blocks  # device blocks, or None when the node lives on the host
        self.host_slots = host_slots
        self.lock = lock  # locks on this node or any descendant

    @property
    def end(self) -> int:
        """Blocks on the path up to and including this node."""
        return self.start + self.length

    @property
    def on_device(self) -> bool:
        return self.blocks is not None


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

    node: RadixNode  # deepest matched node (the root when nothing matched)
    device_blocks: list[int]  # device blocks of the matched path, in order
    num_host_blocks: int  # blocks after those that live on the host tier
    idle_device_blocks: int  # device blocks on the path no one holds: locking removes them
    block_size: int  # from the evictable count

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
    node: RadixNode  # deepest node of the inserted path, locked once for the caller
    blocks: list[int]  # the tree's blocks for the inserted positions (may differ from yours)
