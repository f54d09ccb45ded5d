"""The radix tree of the prefix cache: lookup, locks and splits, over token ids at block granularity.

Only full blocks are cached and shared. A node holds a run of one or more blocks: its key is the
tokens of those blocks (int32 bytes, so comparing a whole node is one memcmp) and its storage is
either device blocks (`blocks`) or host slots (`host_slots`, after a spill). Children are keyed by
the bytes of their first block. What is stored, and when it leaves, is `RadixCache`'s business.

A request (or a pin) that uses a path *locks* it: `lock(node)` adds one to the lock count of the
node and of every ancestor, so lock counts are path counts. A locked node is never evicted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from jaxserve.kv.content_keys import TOKEN_BYTES, token_bytes
from jaxserve.kv.prefix_cache import CachedRun, DroppedBlocks, PrefixMatch
from jaxserve.kv.radix_lru import IdleNodes
from jaxserve.kv.radix_node import RadixNode


class RadixTree:
    """Nodes keyed by token blocks, their locks and their idle order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._kb = block_size * TOKEN_BYTES  # key bytes per block
        self.root = RadixNode(None, b"", 0, 0, [], None)
        self.idle = IdleNodes()

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int] | np.ndarray, *, leave_last_token: bool = True) -> PrefixMatch:
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
                key += token_bytes(tokens[have * bs : grown * bs], (grown - have) * bs)
                have = grown
            child = node.children.get(key[i * kb : (i + 1) * kb])
            if child is None:
                break
            wanted = min(num_blocks, i + child.length)
            if have < wanted:
                grown = min(num_blocks, max(wanted, 2 * have))
                key += token_bytes(tokens[have * bs : grown * bs], (grown - have) * bs)
                have = grown
            n = child.length
            if key[i * kb : (i + n) * kb] == child.key:  # (shorter when the query ends first)
                m = n  # the common case: the whole node matches
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
        if key[i * kb : (i + n) * kb] == node.key[: n * kb]:
            return n
        lo, hi = 1, n - 1  # blocks [0, lo) match; answer < n
        while lo < hi:  # binary search on the (monotone) "first k blocks equal"
            mid = (lo + hi + 1) // 2
            if key[i * kb : (i + mid) * kb] == node.key[: mid * kb]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def device_prefix(self, node: RadixNode) -> RadixNode:
        """The deepest node of `node`'s path that is on the device (the root when none is)."""
        while node.blocks is None:
            node = node.parent
        return node

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
                self.idle.remove(node)
            node.lock += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        root = self.root
        while node is not root:  # leaf to root, so idle nodes precede their ancestors
            if node.lock <= 0:
                raise ValueError("unlock of a node that is not locked")
            node.lock -= 1
            if node.lock == 0:
                self.idle.add(node)
            node = node.parent

    # ------------------------------------------------------------------ structure

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Cut `node` after its first m blocks; return the new upper node (node stays the lower)."""
        kb = self._kb
        parent = node.parent
        upper = RadixNode(parent, node.key[: m * kb], node.start, m, None, None, node.lock)
        if node.blocks is not None:
            upper.blocks = node.blocks[:m]
            node.blocks = node.blocks[m:]
        else:
            upper.host_slots = node.host_slots[:m]
            node.host_slots = node.host_slots[m:]
        node.key = node.key[m * kb :]
        node.start += m
        node.length -= m
        upper.children = {node.key[:kb]: node}
        node.parent = upper
        parent.children[upper.key[:kb]] = upper
        if node.lock == 0:
            # Idle block counts are unchanged (blocks moved between idle nodes); the new upper
            # node must come after `node` and before its own ancestors in the LRU.
            (self.idle.device if upper.blocks is not None else self.idle.host)[upper] = None
            self.idle.touch(parent, self.root)
        return upper

    def _detach(self, node: RadixNode) -> None:
        del node.parent.children[node.key[: self._kb]]
        node.parent = None

    # ------------------------------------------------------------------ inspection

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def runs_by_recency(self) -> Iterator[CachedRun]:
        """Every node as a `CachedRun`, most recently used first: the locked ones (in use or
        pinned), then idle device nodes, then idle host nodes, each LRU newest first. A node never
        comes before its parent, so any leading part is a set of whole prefixes."""
        for node in [node for node in self.nodes() if node.lock > 0] + self.idle.newest_first():
            on_device = node.blocks is not None
            yield CachedRun(node, node.parent, node.key, node.blocks if on_device else node.host_slots, on_device)

    def dropped(self, node: RadixNode, take: int) -> DroppedBlocks:
        """The last `take` blocks of `node`, as the lower tiers' write-back sees them."""
        parts = []
        path = node
        while path is not self.root:
            parts.append(path.key)
            path = path.parent
        tokens = np.frombuffer(b"".join(reversed(parts)), dtype=np.int32)
        on_device = node.blocks is not None
        storage = node.blocks if on_device else node.host_slots
        return DroppedBlocks(tokens, node.end - take, storage[node.length - take :], on_device)
