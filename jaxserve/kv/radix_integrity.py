"""A full consistency check of the radix cache, for tests and `KVCacheManager.check_integrity`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxserve.kv.block_pool import RESERVED_BLOCK
from jaxserve.kv.content_keys import TOKEN_BYTES
from jaxserve.kv.radix_node import RadixNode

if TYPE_CHECKING:
    from jaxserve.kv.radix_cache import RadixCache


@dataclass
class _Recount:
    """What the walk over the tree found, to compare with the cache's own counters."""

    device_lru: dict[RadixNode, int]  # idle device node -> its position in the LRU
    host_lru: dict[RadixNode, int]
    blocks: set[int] = field(default_factory=set)
    host_slots: set[int] = field(default_factory=set)
    device: int = 0
    host: int = 0
    idle_device: int = 0
    idle_host: int = 0
    idle_nodes: int = 0


def check_radix_cache(cache: RadixCache, direct_locks: Mapping[RadixNode, int] | None = None) -> None:
    """Check structure, tiers, lock counts, LRU order and counters; raise AssertionError.

    `direct_locks` maps each node to the number of holders (requests, pins) that locked it;
    when given, every lock count must equal its own holders plus its children's counts.
    """
    kb = cache.block_size * TOKEN_BYTES
    seen = _Recount({n: i for i, n in enumerate(cache.idle.device)}, {n: i for i, n in enumerate(cache.idle.host)})
    stack = [cache.root]
    while stack:
        node = stack.pop()
        child_locks = _check_children(node, kb)
        stack.extend(node.children.values())
        if node is cache.root:
            continue
        _check_node(node, kb, child_locks, direct_locks)
        if node.blocks is not None:
            _count_device_node(cache, node, seen)
        else:
            _count_host_node(cache, node, seen)
        if node.lock == 0:
            _check_lru_order(cache, node, seen)
    if len(seen.device_lru) + len(seen.host_lru) != seen.idle_nodes:
        raise AssertionError("LRU holds nodes that are not in the tree")
    expected = (cache.num_device_blocks, cache.num_host_blocks, cache.idle.device_blocks, cache.idle.host_blocks)
    actual = (seen.device, seen.host, seen.idle_device, seen.idle_host)
    if expected != actual:
        raise AssertionError(f"counters {expected} != recount {actual}")


def _check_children(node: RadixNode, kb: int) -> int:
    """Check the links to `node`'s children; returns the sum of their lock counts."""
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
    return child_locks


def _check_node(node: RadixNode, kb: int, child_locks: int, direct_locks: Mapping[RadixNode, int] | None) -> None:
    if node.length < 1 or len(node.key) != node.length * kb:
        raise AssertionError("node key length does not match its block count")
    if (node.blocks is None) == (node.host_slots is None):
        raise AssertionError("node must live on exactly one tier")
    if direct_locks is not None:
        own = direct_locks.get(node, 0)
        if node.lock != own + child_locks:
            raise AssertionError(f"lock count {node.lock} != {own} holders + {child_locks} below")
    if node.lock < child_locks:
        raise AssertionError("lock count below the sum of the children's")


def _count_device_node(cache: RadixCache, node: RadixNode, seen: _Recount) -> None:
    idle = node.lock == 0
    refcount = cache.pool.refcount
    if len(node.blocks) != node.length:
        raise AssertionError("device node block count mismatch")
    for block in node.blocks:
        if block == RESERVED_BLOCK or block in seen.blocks:
            raise AssertionError(f"block {block} reserved or cached twice")
        seen.blocks.add(block)
        if refcount[block] < 1 or (idle and refcount[block] != 1):
            raise AssertionError(f"cached block {block} has refcount {refcount[block]} (idle={idle})")
    seen.device += node.length
    if idle:
        seen.idle_device += node.length
        seen.idle_nodes += 1
    if idle != (node in seen.device_lru) or node in seen.host_lru:
        raise AssertionError("device node LRU membership wrong")


def _count_host_node(cache: RadixCache, node: RadixNode, seen: _Recount) -> None:
    idle = node.lock == 0
    if len(node.host_slots) != node.length:
        raise AssertionError("host node host slot count mismatch")
    for host_slot in node.host_slots:
        if host_slot in seen.host_slots or not cache.host.is_in_use(host_slot):
            raise AssertionError(f"host slot {host_slot} cached twice or not in use")
        seen.host_slots.add(host_slot)
    seen.host += node.length
    if idle:
        seen.idle_host += node.length
        seen.idle_nodes += 1
    if idle != (node in seen.host_lru) or node in seen.device_lru:
        raise AssertionError("host node LRU membership wrong")


def _check_lru_order(cache: RadixCache, node: RadixNode, seen: _Recount) -> None:
    """An idle node comes before its idle ancestors of the same tier in that tier's LRU."""
    positions = seen.device_lru if node.blocks is not None else seen.host_lru
    ancestor = node.parent
    while ancestor is not cache.root and ancestor.lock == 0:
        other = seen.device_lru if ancestor.blocks is not None else seen.host_lru
        if other is positions and other[ancestor] < positions[node]:
            raise AssertionError("an idle ancestor precedes its descendant in the LRU")
        ancestor = ancestor.parent
