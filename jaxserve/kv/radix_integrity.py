"""A full consistency check of the radix cache, for tests and `KVCacheManager.check_integrity`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.kv.block_pool import RESERVED_BLOCK
from jaxserve.kv.radix_node import TOKEN_BYTES, RadixNode

if TYPE_CHECKING:
    from jaxserve.kv.radix_cache import RadixCache


def check_radix_cache(cache: RadixCache, direct_locks: dict[RadixNode, int] | None = None) -> None:
    """Check structure, tiers, lock counts, LRU order and counters; raise AssertionError.

    `direct_locks` maps each node to the number of holders (requests, pins) that locked it;
    when given, every lock count must equal its own holders plus its children's counts.
    """
    kb = cache.block_size * TOKEN_BYTES
    root = cache.root
    device_lru_pos = {node: i for i, node in enumerate(cache.idle.device)}
    host_lru_pos = {node: i for i, node in enumerate(cache.idle.host)}
    seen_blocks: set[int] = set()
    seen_slots: set[int] = set()
    totals = {"device": 0, "host": 0, "idle_device": 0, "idle_host": 0}
    refcount = cache.pool.refcount
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
            raise AssertionError(f"lock count {node.lock} != {own} holders + {child_locks} below")
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
                    raise AssertionError(f"cached block {block} has refcount {refcount[block]} (idle={idle})")
            totals["device"] += node.length
            if idle:
                totals["idle_device"] += node.length
            if idle != (node in device_lru_pos) or node in host_lru_pos:
                raise AssertionError("device node LRU membership wrong")
        else:
            if len(node.host_slots) != node.length:
                raise AssertionError("host node slot count mismatch")
            for slot in node.host_slots:
                if slot in seen_slots or not cache.host.is_in_use(slot):
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
    expected = (cache.num_device_blocks, cache.num_host_blocks, cache.idle.device_blocks, cache.idle.host_blocks)
    actual = (totals["device"], totals["host"], totals["idle_device"], totals["idle_host"])
    if expected != actual:
        raise AssertionError(f"counters {expected} != recount {actual}")
