"""Radix prefix cache over token ids, at block granularity.

Only full blocks are cached and shared. A node holds a run of one or more blocks: its key is the
tokens of those blocks (int32 bytes, so comparing a whole node is one memcmp) and its storage is
either device blocks (`blocks`) or host slots (`host_slots`, after a spill). Children are keyed by
the bytes of their first block.

Rules that keep it correct and fast:

* The tree holds one pool reference on every device block it stores. A request (or a pin) that
  uses a path *locks* it: `lock(node)` adds one to the lock count of the node and of every
  ancestor, so lock counts are path counts. A locked node is never evicted, from either tier.
* The device part of the tree is closed upwards: a device node's parent is on the device, so a
  path is "device blocks, then maybe host slots". Spilling goes leaf-first and reloading goes
  root-first, which keeps that so.
* Idle (unlocked) nodes sit in one LRU per tier (an OrderedDict, oldest first) ordered so that
  every node comes before its idle ancestors. Because a locked node's ancestors are locked, the
  first device entry has no device children and the first host entry has no children at all:
  eviction takes the first entry, in O(1), without scanning for leaves. The order is kept by
  appending in leaf-to-root order whenever nodes become idle or are touched.
* An idle device node's blocks have exactly one reference (the tree's), so evicting n idle
  blocks frees exactly n blocks and `num_evictable_blocks` is exact. The tree only adopts a
  caller's block when the caller is its single holder (refcount 1), and locks what it adopted
  for the caller; a block shared by forked requests is adopted once the sharing ends.
* Eviction takes blocks from the tail of the oldest leaf (splitting it), spilling them to the
  host tier when there is one (planning device -> host copies), else dropping them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jaxserve.kv.block_pool import RESERVED_BLOCK, BlockPool, NoFreeBlocksError
from jaxserve.kv.copy_plan import CopyKind, CopyPlan
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.radix_node import TOKEN_BYTES, CacheStats, InsertResult, PrefixMatch, RadixNode, token_bytes

_ABSENT = object()



class RadixCache:
    """Prefix cache of full KV blocks with LRU eviction and an optional host tier."""

    def __init__(self, pool: BlockPool, host: HostTier | None = None,
                 copies: CopyPlan | None = None, *, spill_to_host: bool = True) -> None:
        self.pool = pool
        self.host = host
        self.copies = copies if copies is not None else CopyPlan()
        self.spill_to_host = spill_to_host and host is not None and host.num_slots > 0
        self.block_size = pool.block_size
        self._kb = pool.block_size * TOKEN_BYTES   # key bytes per block
        self.root = RadixNode(None, b"", 0, 0, [], None)
        self._device_lru: OrderedDict[RadixNode, None] = OrderedDict()
        self._host_lru: OrderedDict[RadixNode, None] = OrderedDict()
        self._idle_device_blocks = 0
        self._idle_host_blocks = 0
        self._device_blocks = 0
        self._host_blocks = 0
        self.stats = CacheStats()
        # Called with (node, n) just before the last n blocks of an idle node leave the cache
        # (dropped from the device without a host slot, or from the host): the disk tier's
        # write-back. Not called by `clear`.
        self.on_drop: Callable[[RadixNode, int], None] | None = None

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
        return self._idle_device_blocks

    @property
    def num_evictable_host_blocks(self) -> int:
        return self._idle_host_blocks

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int] | np.ndarray, *,
              leave_last_token: bool = True) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole blocks.

        With `leave_last_token` (prompts) at most `len(tokens) - 1` tokens match, so the last
        prompt token is always computed and yields logits. A match ending inside a node splits
        it, so the matched part can be locked on its own. Nothing is locked here.
        """
        bs = self.block_size
        n_tokens = len(tokens) - 1 if leave_last_token else len(tokens)
        num_blocks = max(n_tokens, 0) // bs
        # Converting a list of ints costs ~0.1 us per token, so convert only as far as the walk
        # gets (doubling), and a miss costs one block. numpy input converts at memcpy speed.
        have = num_blocks if isinstance(tokens, np.ndarray) else 0
        key = token_bytes(tokens, have * bs)
        kb = self._kb
        node = self.root
        device_blocks: list[int] = []
        host_blocks = 0
        idle = 0
        i = 0
        while i < num_blocks:
            if have <= i:
                grown = min(num_blocks, max(i + 1, 2 * have))
                key += token_bytes(tokens[have * bs:grown * bs], (grown - have) * bs)
                have = grown
            child = node.children.get(key[i * kb:(i + 1) * kb])
            if child is None:
                break
            wanted = min(num_blocks, i + child.length)
            if have < wanted:
                grown = min(num_blocks, max(wanted, 2 * have))
                key += token_bytes(tokens[have * bs:grown * bs], (grown - have) * bs)
                have = grown
            n = child.length
            if key[i * kb:(i + n) * kb] == child.key:   # (shorter when the query ends first)
                m = n                               # the common case: the whole node matches
            else:
                m = self._common_blocks(child, key, i, num_blocks)
                if m < n:
                    child = self._split(child, m)
            if child.blocks is not None:
                device_blocks.extend(child.blocks)
                if child.lock == 0:
                    idle += m
            else:
                host_blocks += m
            node = child
            i += m
        return PrefixMatch(node, device_blocks, host_blocks, idle, self.block_size)

    def _common_blocks(self, node: RadixNode, key: bytes, i: int, num_blocks: int) -> int:
        """How many leading blocks of `node` equal key blocks i, i+1, ... (the first one does)."""
        kb = self._kb
        n = min(node.length, num_blocks - i)
        if key[i * kb:(i + n) * kb] == node.key[:n * kb]:
            return n
        lo, hi = 1, n - 1   # blocks [0, lo) match; answer < n
        while lo < hi:      # binary search on the (monotone) "first k blocks equal"
            mid = (lo + hi + 1) // 2
            if key[i * kb:(i + mid) * kb] == node.key[:mid * kb]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def path_blocks(self, node: RadixNode) -> list[int]:
        """Device blocks from the root to `node` (all of its path must be on the device)."""
        parts: list[list[int]] = []
        while node is not self.root:
            if node.blocks is None:
                raise ValueError("path_blocks of a path that is partly on the host")
            parts.append(node.blocks)
            node = node.parent
        return [block for part in reversed(parts) for block in part]

    # ------------------------------------------------------------------ locks

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction until `unlock(node)`."""
        root = self.root
        while node is not root:
            if node.lock == 0:
                self._make_busy(node)
            node.lock += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        root = self.root
        while node is not root:     # leaf to root, so idle nodes precede their ancestors
            if node.lock <= 0:
                raise ValueError("unlock of a node that is not locked")
            node.lock -= 1
            if node.lock == 0:
                self._make_idle(node)
            node = node.parent

    def _make_busy(self, node: RadixNode) -> None:
        """Take an idle node out of its LRU (a node just created by insert is in none)."""
        if node.blocks is not None:
            if self._device_lru.pop(node, _ABSENT) is not _ABSENT:
                self._idle_device_blocks -= node.length
        elif self._host_lru.pop(node, _ABSENT) is not _ABSENT:
            self._idle_host_blocks -= node.length

    def _make_idle(self, node: RadixNode) -> None:
        if node.blocks is not None:
            self._device_lru[node] = None
            self._idle_device_blocks += node.length
        else:
            self._host_lru[node] = None
            self._idle_host_blocks += node.length

    def _touch(self, node: RadixNode) -> None:
        """Move `node` and its idle ancestors to the recent end, leaf first."""
        root = self.root
        while node is not root and node.lock == 0:
            (self._device_lru if node.blocks is not None else self._host_lru).move_to_end(node)
            node = node.parent

    # ------------------------------------------------------------------ structure

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Cut `node` after its first m blocks; return the new upper node (node stays the lower)."""
        kb = self._kb
        parent = node.parent
        upper = RadixNode(parent, node.key[:m * kb], node.start, m, None, None, node.lock)
        if node.blocks is not None:
            upper.blocks = node.blocks[:m]
            node.blocks = node.blocks[m:]
        else:
            upper.host_slots = node.host_slots[:m]
            node.host_slots = node.host_slots[m:]
        node.key = node.key[m * kb:]
        node.start += m
        node.length -= m
        upper.children = {node.key[:kb]: node}
        node.parent = upper
        parent.children[upper.key[:kb]] = upper
        if node.lock == 0:
            # Idle block counts are unchanged (blocks moved between idle nodes); the new upper
            # node must come after `node` and before its own ancestors in the LRU.
            (self._device_lru if upper.blocks is not None else self._host_lru)[upper] = None
            self._touch(parent)
        return upper

    def _detach(self, node: RadixNode) -> None:
        del node.parent.children[node.key[:self._kb]]
        node.parent = None

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: Sequence[int] | np.ndarray, blocks: Sequence[int], *,
               parent: RadixNode | None = None) -> InsertResult:
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
            raise ValueError(f"{num_blocks} blocks need {num_blocks * self.block_size} tokens, "
                             f"got {len(tokens)}")
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
            child = node.children.get(key[i * kb:(i + 1) * kb])
            if child is None:
                j = i
                while j < num_blocks and refcount[blocks[j]] == 1:
                    j += 1
                if j > i:
                    node = self._add_blocks(node, start, key[i * kb:j * kb], list(blocks[i:j]))
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
                self._adopt_from_host(child, list(blocks[i:i + m]))
            elif m < child.length:
                child = self._split(child, m)
            out.extend(child.blocks)
            node = child
            i += m
        self.lock(node)
        return InsertResult(node, out)

    def _add_blocks(self, node: RadixNode, start: RadixNode, key: bytes,
                    blocks: list[int]) -> RadixNode:
        """Store new device blocks after `node`; return the node that now ends with them."""
        for block in blocks:
            if block == RESERVED_BLOCK:
                raise ValueError("the reserved block 0 cannot be cached")
            self.pool.incref(block)
        self._device_blocks += len(blocks)
        if (node is start and node is not self.root and not node.children and node.lock == 1):
            # The caller's own leaf (only its lock on it): grow it in place, so a long
            # conversation stays one node instead of one node per block.
            node.key += key
            node.blocks.extend(blocks)
            node.length += len(blocks)
            return node
        child = RadixNode(node, key, node.end, len(blocks), blocks, None)
        node.children[key[:self._kb]] = child
        self._make_idle(child)      # locked by insert() right after; kept consistent meanwhile
        self._touch(node)
        return child

    def _adopt_from_host(self, node: RadixNode, blocks: list[int]) -> None:
        for block in blocks:
            self.pool.incref(block)
        if node.lock == 0:
            self._make_busy(node)
        self.host.free(node.host_slots)
        node.host_slots = None
        node.blocks = blocks
        self._host_blocks -= node.length
        self._device_blocks += node.length
        if node.lock == 0:
            self._make_idle(node)
            self._touch(node)

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
            for slot, block in zip(host_node.host_slots, blocks):
                self.copies.add(CopyKind.HOST_TO_DEVICE, slot, block)
            self.host.free(host_node.host_slots)
            host_node.host_slots = None
            host_node.blocks = blocks        # the tree's reference is the one allocate() gave
            self._host_blocks -= host_node.length
            self._device_blocks += host_node.length
            loaded.extend(blocks)
        return loaded

    def insert_host(self, parent: RadixNode, tokens: bytes, slots: list[int]) -> tuple[RadixNode, list[int]]:
        """Add blocks read into host slots (from the disk tier) below `parent` (locked by the caller).

        `tokens` are the blocks' token ids as int32 bytes, continuing `parent`'s path. Positions
        the tree has already (computed meanwhile) keep the tree's storage; their slots are
        returned for the caller to free. The rest becomes one new idle host node. Returns the
        deepest node of the path (not locked) and the slots not taken.
        """
        kb = self._kb
        n = len(slots)
        if len(tokens) != n * kb:
            raise ValueError(f"{n} slots need {n * kb} token bytes, got {len(tokens)}")
        if parent is not self.root and parent.lock <= 0:
            raise ValueError("insert_host below a parent the caller has not locked")
        node, i = parent, 0
        while i < n:
            child = node.children.get(tokens[i * kb:(i + 1) * kb])
            if child is None:
                new = RadixNode(node, tokens[i * kb:], node.end, n - i, None, slots[i:])
                node.children[new.key[:kb]] = new
                self._host_blocks += n - i
                self._make_idle(new)
                self._touch(node)
                return new, slots[:i]
            m = self._common_blocks(child, tokens, i, n)
            if m < child.length:
                child = self._split(child, m)
            node = child
            i += m
        return node, slots

    # ------------------------------------------------------------------ eviction

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the pool, evicting idle cached blocks if the free list is short."""
        pool = self.pool
        short = n - pool.num_free
        if short > 0:
            if short > self._idle_device_blocks:
                raise NoFreeBlocksError(f"asked for {n} blocks: {pool.num_free} free, "
                                        f"{self._idle_device_blocks} evictable")
            self.evict(short)
        return pool.allocate(n)

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` device blocks from idle leaves, least recently used first."""
        freed = 0
        lru = self._device_lru
        while freed < num_blocks and lru:
            node = next(iter(lru))
            take = min(num_blocks - freed, node.length)
            self._evict_device_tail(node, take)
            freed += take
        return freed

    def _evict_device_tail(self, node: RadixNode, take: int) -> None:
        kb = self._kb
        tail = node.blocks[node.length - take:]
        whole = take == node.length
        slots = self.reserve_host(take) if self.spill_to_host else None
        if slots is not None:
            for block, slot in zip(tail, slots):
                self.copies.add(CopyKind.DEVICE_TO_HOST, block, slot)
            if whole:
                del self._device_lru[node]
                self._idle_device_blocks -= take
                node.blocks = None
                node.host_slots = slots
                self._make_idle(node)
            else:
                spilled = RadixNode(node, node.key[-take * kb:], node.end - take, take, None, slots)
                spilled.children = node.children
                for child in spilled.children.values():
                    child.parent = spilled
                node.children = {spilled.key[:kb]: spilled}
                self._trim(node, take)
                self._idle_device_blocks -= take
                self._make_idle(spilled)
            self._host_blocks += take
        else:
            self._drop_host_subtrees(node)
            if self.on_drop is not None:
                self.on_drop(node, take)
            if whole:
                del self._device_lru[node]
                self._detach(node)
            else:
                self._trim(node, take)
            self._idle_device_blocks -= take
        self._device_blocks -= take
        self.stats.device_evictions += take
        pool = self.pool
        for block in tail:
            if not pool.decref(block):
                raise AssertionError(f"evicted block {block} is still referenced")

    def _trim(self, node: RadixNode, take: int) -> None:
        """Cut the last `take` blocks off `node` (the caller takes care of their storage)."""
        node.key = node.key[:(node.length - take) * self._kb]
        node.blocks = node.blocks[:node.length - take]
        node.length -= take

    def _drop_host_subtrees(self, node: RadixNode) -> None:
        """Drop every (idle, host-resident) descendant of an idle device leaf."""
        stack = list(node.children.values())
        node.children = {}
        while stack:
            child = stack.pop()
            stack.extend(child.children.values())
            if self.on_drop is not None:
                self.on_drop(child, child.length)
            self.stats.host_evictions += child.length
            del self._host_lru[child]
            self._idle_host_blocks -= child.length
            self._host_blocks -= child.length
            self.host.free(child.host_slots)
            child.parent = None

    def can_reserve_host(self, n: int) -> bool:
        host = self.host
        return host is not None and host.num_free + self._idle_host_blocks >= n

    def reserve_host(self, n: int) -> list[int] | None:
        """Take n host slots, evicting idle cached host blocks if needed; None if impossible."""
        if not self.can_reserve_host(n):
            return None
        short = n - self.host.num_free
        if short > 0:
            self.evict_host(short)
        return self.host.allocate(n)

    def evict_host(self, num_slots: int) -> int:
        """Free up to `num_slots` host slots from idle host leaves, least recently used first."""
        freed = 0
        lru = self._host_lru
        while freed < num_slots and lru:
            node = next(iter(lru))
            take = min(num_slots - freed, node.length)
            if self.on_drop is not None:
                self.on_drop(node, take)
            self.stats.host_evictions += take
            self.host.free(node.host_slots[node.length - take:])
            if take == node.length:
                del lru[node]
                self._detach(node)
            else:
                node.key = node.key[:(node.length - take) * self._kb]
                node.host_slots = node.host_slots[:node.length - take]
                node.length -= take
            self._idle_host_blocks -= take
            self._host_blocks -= take
            freed += take
        return freed

    def clear(self) -> int:
        """Drop every idle cached block on both tiers, without spilling; returns blocks freed."""
        spill, self.spill_to_host = self.spill_to_host, False
        on_drop, self.on_drop = self.on_drop, None
        try:
            freed = self.evict(self._idle_device_blocks)
            self.evict_host(self._idle_host_blocks)
        finally:
            self.spill_to_host = spill
            self.on_drop = on_drop
        return freed

    # ------------------------------------------------------------------ inspection

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def nodes_by_recency(self) -> list[RadixNode]:
        """Every node but the root, most recently used first: the locked ones (in use or pinned),
        then idle device nodes, then idle host nodes, each LRU newest first. A node never comes
        before its parent, so any leading part of the list is a set of whole prefixes."""
        locked = [node for node in self.nodes() if node.lock > 0]
        return locked + list(reversed(self._device_lru)) + list(reversed(self._host_lru))

    def device_blocks(self) -> Iterator[int]:
        for node in self.nodes():
            if node.blocks is not None:
                yield from node.blocks

    def host_slots(self) -> Iterator[int]:
        for node in self.nodes():
            if node.host_slots is not None:
                yield from node.host_slots

    def node_tokens(self, node: RadixNode) -> np.ndarray:
        """The token ids of the path from the root to the end of `node`."""
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent
        return np.frombuffer(b"".join(reversed(parts)), dtype=np.int32)

    def check_integrity(self, direct_locks: dict[RadixNode, int] | None = None) -> None:
        """Check structure, tiers, lock counts, LRU order and counters; raise AssertionError.

        `direct_locks` maps each node to the number of holders (requests, pins) that locked it;
        when given, every lock count must equal its own holders plus its children's counts.
        """
        kb = self._kb
        root = self.root
        device_lru_pos = {node: i for i, node in enumerate(self._device_lru)}
        host_lru_pos = {node: i for i, node in enumerate(self._host_lru)}
        seen_blocks: set[int] = set()
        seen_slots: set[int] = set()
        totals = {"device": 0, "host": 0, "idle_device": 0, "idle_host": 0}
        refcount = self.pool.refcount
        idle_nodes = 0
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                if child.parent is not node:
                    raise AssertionError("child's parent pointer is wrong")
                if first != child.key[:kb]:
                    raise AssertionError("child keyed by the wrong first block")
                if child.start != node.end:
                    raise AssertionError("child start does not follow its parent")
                if node.blocks is None and child.blocks is not None:
                    raise AssertionError("device node below a host node")
                child_locks += child.lock
                stack.append(child)
            if node is root:
                continue
            if node.length < 1 or len(node.key) != node.length * kb:
                raise AssertionError("node key length does not match its block count")
            if (node.blocks is None) == (node.host_slots is None):
                raise AssertionError("node must live on exactly one tier")
            own = direct_locks.get(node, 0) if direct_locks is not None else 0
            if direct_locks is not None and node.lock != own + child_locks:
                raise AssertionError(
                    f"lock count {node.lock} != {own} holders + {child_locks} below")
            if node.lock < child_locks:
                raise AssertionError("lock count below the sum of the children's")
            idle = node.lock == 0
            idle_nodes += idle
            if node.blocks is not None:
                if len(node.blocks) != node.length:
                    raise AssertionError("device node block count mismatch")
                for block in node.blocks:
                    if block == RESERVED_BLOCK or block in seen_blocks:
                        raise AssertionError(f"block {block} reserved or cached twice")
                    seen_blocks.add(block)
                    if refcount[block] < 1 or (idle and refcount[block] != 1):
                        raise AssertionError(
                            f"cached block {block} has refcount {refcount[block]} (idle={idle})")
                totals["device"] += node.length
                if idle:
                    totals["idle_device"] += node.length
                if idle != (node in device_lru_pos) or node in host_lru_pos:
                    raise AssertionError("device node LRU membership wrong")
            else:
                if len(node.host_slots) != node.length:
                    raise AssertionError("host node slot count mismatch")
                for slot in node.host_slots:
                    if slot in seen_slots or not self.host.is_in_use(slot):
                        raise AssertionError(f"host slot {slot} cached twice or not in use")
                    seen_slots.add(slot)
                totals["host"] += node.length
                if idle:
                    totals["idle_host"] += node.length
                if idle != (node in host_lru_pos) or node in device_lru_pos:
                    raise AssertionError("host node LRU membership wrong")
            if idle:
                positions = device_lru_pos if node.blocks is not None else host_lru_pos
                ancestor = node.parent
                while ancestor is not root and ancestor.lock == 0:
                    other = device_lru_pos if ancestor.blocks is not None else host_lru_pos
                    if other is positions and other[ancestor] < positions[node]:
                        raise AssertionError("an idle ancestor precedes its descendant in the LRU")
                    ancestor = ancestor.parent
        if len(device_lru_pos) + len(host_lru_pos) != idle_nodes:
            raise AssertionError("LRU holds nodes that are not in the tree")
        expected = (self._device_blocks, self._host_blocks, self._idle_device_blocks,
                    self._idle_host_blocks)
        actual = (totals["device"], totals["host"], totals["idle_device"], totals["idle_host"])
        if expected != actual:
            raise AssertionError(f"counters {expected} != recount {actual}")
