"""Radix prefix cache: full KV blocks stored in a `RadixTree` (radix_tree.py), on the device or
spilled to the host tier.

Rules that keep it correct and fast:

* The tree holds one pool reference on every device block it stores. A locked path (a request or
  a pin uses it) is never evicted, from either tier.
* The device part of the tree is closed upwards: a device node's parent is on the device, so a
  path is "device blocks, then maybe host slots". Spilling goes leaf-first and reloading goes
  root-first, which keeps that so.
* Idle (unlocked) nodes sit in one LRU per tier (`radix_lru.IdleNodes`), ordered so that the
  first entry of each can be evicted without scanning for leaves.
* An idle device node's blocks have exactly one reference (the tree's), so evicting n idle
  blocks frees exactly n blocks and `num_evictable_blocks` is exact. The tree only adopts a
  caller's block when the caller is its single holder (refcount 1), and locks what it adopted
  for the caller; a block shared by forked requests is adopted once the sharing ends.
* Eviction takes blocks from the tail of the oldest leaf (splitting it), spilling them to the
  host tier when there is one (planning device -> host copies), else dropping them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from jaxserve.kv.block_pool import RESERVED_BLOCK, BlockPool, NoFreeBlocksError
from jaxserve.kv.content_keys import token_bytes
from jaxserve.kv.copy_plan import CopyKind, CopyPlan
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.prefix_cache import CacheStats, DroppedBlocks, InsertResult
from jaxserve.kv.radix_integrity import check_radix_cache
from jaxserve.kv.radix_node import RadixNode
from jaxserve.kv.radix_tree import RadixTree


class RadixCache(RadixTree):
    """Prefix cache of full KV blocks with LRU eviction and an optional host tier: the tree
    (`RadixTree`: lookup, locks, splits) plus what it stores and when blocks leave it. A
    `SpillingPrefixCache` (prefix_cache.py)."""

    def __init__(
        self,
        pool: BlockPool,
        host: HostTier | None = None,
        copies: CopyPlan | None = None,
        *,
        spill_to_host: bool = True,
    ) -> None:
        self.pool = pool
        self.host = host if host is not None else HostTier(0)
        self.copies = copies if copies is not None else CopyPlan()
        self.spill_to_host = spill_to_host and self.host.num_host_slots > 0
        super().__init__(pool.block_size)
        self._device_blocks = 0
        self._host_blocks = 0
        self.stats = CacheStats()
        # Called just before blocks of an idle node leave the cache (dropped from the device
        # without a host slot, or from the host): the lower tiers' write-back. Not called by `clear`.
        self.on_drop: Callable[[DroppedBlocks], None] | None = None

    # ------------------------------------------------------------------ sizes

    @property
    def num_device_blocks(self) -> int:
        """Device blocks stored in the tree."""
        return self._device_blocks

    @property
    def num_host_blocks(self) -> int:
        """Host slots holding spilled cached blocks."""
        return self._host_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Device blocks no request or pin holds: eviction can free exactly this many."""
        return self.idle.device_blocks

    @property
    def num_evictable_host_blocks(self) -> int:
        return self.idle.host_blocks

    # ------------------------------------------------------------------ insert

    def insert(
        self, tokens: Sequence[int] | np.ndarray, blocks: Sequence[int], *, parent: RadixNode | None = None
    ) -> InsertResult:
        """Add full blocks to the tree and lock the path for the caller.

        `blocks[i]` holds the KV of `tokens[i*bs:(i+1)*bs]`; both continue the path that ends at
        `parent` (the root by default; a non-root parent must be locked by the caller). Where the
        tree already has a position it keeps its own block and returns it in `result.blocks` so
        the caller can switch to it and drop its duplicate. Where it lacks one it adopts the
        caller's block (taking its own reference) only if the caller is the block's single
        holder; insertion stops at the first block it may not adopt, so `result.blocks` can be
        shorter than `blocks`. `result.node` ends exactly after the inserted positions and is
        locked once for the caller; unlock it when you drop your references.
        Call this only after the KV of those blocks has been written.
        """
        num_blocks = len(blocks)
        if len(tokens) < num_blocks * self.block_size:
            raise ValueError(f"{num_blocks} blocks need {num_blocks * self.block_size} tokens, got {len(tokens)}")
        start = self.root if parent is None else parent
        if start.blocks is None:
            raise ValueError("insert below a node that lives on the host")
        if start is not self.root and start.lock <= 0:
            raise ValueError("insert below a parent the caller has not locked")
        key = token_bytes(tokens, num_blocks * self.block_size)
        kb = self._kb
        refcount = self.pool.refcount
        node = start
        out: list[int] = []
        i = 0
        while i < num_blocks:
            child = node.children.get(key[i * kb : (i + 1) * kb])
            if child is None:
                j = i
                while j < num_blocks and refcount[blocks[j]] == 1:
                    j += 1
                if j > i:
                    node = self._add_blocks(node, start, key[i * kb : j * kb], list(blocks[i:j]))
                    out.extend(blocks[i:j])
                break
            m = self._common_blocks(child, key, i, num_blocks)
            if child.blocks is None:
                # Spilled to the host: take the caller's fresh device copy instead (as far as
                # the caller is the single holder), which also saves the reload.
                r = 0
                while r < m and refcount[blocks[i + r]] == 1:
                    r += 1
                if r == 0:
                    break
                m = r
                if m < child.length:
                    child = self._split(child, m)
                self._adopt_from_host(child, list(blocks[i : i + m]))
            elif m < child.length:
                child = self._split(child, m)
            out.extend(child.blocks)
            node = child
            i += m
        self.lock(node)
        return InsertResult(node, out)

    def _add_blocks(self, node: RadixNode, start: RadixNode, key: bytes, blocks: list[int]) -> RadixNode:
        """Store new device blocks after `node`; return the node that now ends with them."""
        for block in blocks:
            if block == RESERVED_BLOCK:
                raise ValueError("the reserved block 0 cannot be cached")
            self.pool.incref(block)
        self._device_blocks += len(blocks)
        if node is start and node is not self.root and not node.children and node.lock == 1:
            # The caller's own leaf (only its lock on it): grow it in place, so a long
            # conversation stays one node instead of one node per block.
            node.key += key
            node.blocks.extend(blocks)
            node.length += len(blocks)
            return node
        child = RadixNode(node, key, node.end, len(blocks), blocks, None)
        node.children[key[: self._kb]] = child
        self.idle.add(child)  # locked by insert() right after; kept consistent meanwhile
        self.idle.touch(node, self.root)
        return child

    def _adopt_from_host(self, node: RadixNode, blocks: list[int]) -> None:
        for block in blocks:
            self.pool.incref(block)
        if node.lock == 0:
            self.idle.remove(node)
        self.host.free(node.host_slots)
        node.host_slots = None
        node.blocks = blocks
        self._host_blocks -= node.length
        self._device_blocks += node.length
        if node.lock == 0:
            self.idle.add(node)
            self.idle.touch(node, self.root)

    # ------------------------------------------------------------------ host reload

    def load_to_device(self, node: RadixNode) -> list[int]:
        """Copy the host part of the locked path ending at `node` back to the device.

        Plans host -> device copies; returns the new device blocks, root side first. The caller
        must have checked that enough blocks are free or evictable.
        """
        if node.lock <= 0:
            raise ValueError("load_to_device needs a locked path")
        chain: list[RadixNode] = []
        while node.blocks is None:
            chain.append(node)
            node = node.parent
        loaded: list[int] = []
        for host_node in reversed(chain):
            blocks = self.allocate(host_node.length)
            for host_slot, block in zip(host_node.host_slots, blocks):
                self.copies.add(CopyKind.HOST_TO_DEVICE, host_slot, block)
            self.host.free(host_node.host_slots)
            host_node.host_slots = None
            host_node.blocks = blocks  # the tree's reference is the one allocate() gave
            self._host_blocks -= host_node.length
            self._device_blocks += host_node.length
            loaded.extend(blocks)
        return loaded

    def insert_host(self, parent: RadixNode, tokens: bytes, host_slots: list[int]) -> tuple[RadixNode, list[int]]:
        """Add blocks read into host slots (from the disk tier) below `parent` (locked by the caller).

        `tokens` are the blocks' token ids as int32 bytes, continuing `parent`'s path. Positions
        the tree has already (computed meanwhile) keep the tree's storage; their host slots are
        returned for the caller to free. The rest becomes one new idle host node. Returns the
        deepest node of the path (not locked) and the host slots not taken.
        """
        kb = self._kb
        n = len(host_slots)
        if len(tokens) != n * kb:
            raise ValueError(f"{n} host slots need {n * kb} token bytes, got {len(tokens)}")
        if parent is not self.root and parent.lock <= 0:
            raise ValueError("insert_host below a parent the caller has not locked")
        node, i = parent, 0
        while i < n:
            child = node.children.get(tokens[i * kb : (i + 1) * kb])
            if child is None:
                new = RadixNode(node, tokens[i * kb :], node.end, n - i, None, host_slots[i:])
                node.children[new.key[:kb]] = new
                self._host_blocks += n - i
                self.idle.add(new)
                self.idle.touch(node, self.root)
                return new, host_slots[:i]
            m = self._common_blocks(child, tokens, i, n)
            if m < child.length:
                child = self._split(child, m)
            node = child
            i += m
        return node, host_slots

    # ------------------------------------------------------------------ eviction

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the pool, evicting idle cached blocks if the free list is short."""
        pool = self.pool
        short = n - pool.num_free
        if short > 0:
            if short > self.idle.device_blocks:
                raise NoFreeBlocksError(
                    f"asked for {n} blocks: {pool.num_free} free, {self.idle.device_blocks} evictable"
                )
            self.evict(short)
        return pool.allocate(n)

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` device blocks from idle leaves, least recently used first."""
        freed = 0
        lru = self.idle.device
        while freed < num_blocks and lru:
            node = next(iter(lru))
            take = min(num_blocks - freed, node.length)
            self._evict_device_tail(node, take)
            freed += take
        return freed

    def _evict_device_tail(self, node: RadixNode, take: int) -> None:
        kb = self._kb
        tail = node.blocks[node.length - take :]
        whole = take == node.length
        host_slots = self.reserve_host(take) if self.spill_to_host else None
        if host_slots is not None:
            for block, host_slot in zip(tail, host_slots):
                self.copies.add(CopyKind.DEVICE_TO_HOST, block, host_slot)
            if whole:
                del self.idle.device[node]
                self.idle.device_blocks -= take
                node.blocks = None
                node.host_slots = host_slots
                self.idle.add(node)
            else:
                spilled = RadixNode(node, node.key[-take * kb :], node.end - take, take, None, host_slots)
                spilled.children = node.children
                for child in spilled.children.values():
                    child.parent = spilled
                node.children = {spilled.key[:kb]: spilled}
                self._trim(node, take)
                self.idle.device_blocks -= take
                self.idle.add(spilled)
            self._host_blocks += take
        else:
            self._drop_host_subtrees(node)
            if self.on_drop is not None:
                self.on_drop(self.dropped(node, take))
            if whole:
                del self.idle.device[node]
                self._detach(node)
            else:
                self._trim(node, take)
            self.idle.device_blocks -= take
        self._device_blocks -= take
        self.stats.device_evictions += take
        pool = self.pool
        for block in tail:
            if not pool.decref(block):
                raise AssertionError(f"evicted block {block} is still referenced")

    def _trim(self, node: RadixNode, take: int) -> None:
        """Cut the last `take` blocks off `node` (the caller takes care of their storage)."""
        node.key = node.key[: (node.length - take) * self._kb]
        node.blocks = node.blocks[: node.length - take]
        node.length -= take

    def _drop_host_subtrees(self, node: RadixNode) -> None:
        """Drop every (idle, host-resident) descendant of an idle device leaf."""
        stack = list(node.children.values())
        node.children = {}
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            if self.on_drop is not None:
                self.on_drop(self.dropped(child, child.length))
            self.stats.host_evictions += child.length
            del self.idle.host[child]
            self.idle.host_blocks -= child.length
            self._host_blocks -= child.length
            self.host.free(child.host_slots)
            child.parent = None

    def can_reserve_host(self, n: int) -> bool:
        return self.host.num_free + self.idle.host_blocks >= n

    def reserve_host(self, n: int) -> list[int] | None:
        """Take n host slots, evicting idle cached host blocks if needed; None if impossible."""
        if not self.can_reserve_host(n):
            return None
        short = n - self.host.num_free
        if short > 0:
            self.evict_host(short)
        return self.host.allocate(n)

    def evict_host(self, num_host_slots: int) -> int:
        """Free up to `num_host_slots` host slots from idle host leaves, least recently used first."""
        freed = 0
        lru = self.idle.host
        while freed < num_host_slots and lru:
            node = next(iter(lru))
            take = min(num_host_slots - freed, node.length)
            if self.on_drop is not None:
                self.on_drop(self.dropped(node, take))
            self.stats.host_evictions += take
            self.host.free(node.host_slots[node.length - take :])
            if take == node.length:
                del lru[node]
                self._detach(node)
            else:
                node.key = node.key[: (node.length - take) * self._kb]
                node.host_slots = node.host_slots[: node.length - take]
                node.length -= take
            self.idle.host_blocks -= take
            self._host_blocks -= take
            freed += take
        return freed

    def clear(self) -> int:
        """Drop every idle cached block on both tiers, without spilling; returns blocks freed."""
        spill, self.spill_to_host = self.spill_to_host, False
        on_drop, self.on_drop = self.on_drop, None
        try:
            freed = self.evict(self.idle.device_blocks)
            self.evict_host(self.idle.host_blocks)
        finally:
            self.spill_to_host = spill
            self.on_drop = on_drop
        return freed

    # ------------------------------------------------------------------ inspection

    def device_blocks(self) -> Iterator[int]:
        for node in self.nodes():
            if node.blocks is not None:
                yield from node.blocks

    def host_slots(self) -> Iterator[int]:
        for node in self.nodes():
            if node.host_slots is not None:
                yield from node.host_slots

    def check_integrity(self, direct_locks: Mapping[RadixNode, int] | None = None) -> None:
        """Check structure, tiers, lock counts, LRU order and counters; raise AssertionError
        (`radix_integrity.check_radix_cache`)."""
        check_radix_cache(self, direct_locks)
