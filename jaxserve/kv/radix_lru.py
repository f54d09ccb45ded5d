"""The idle nodes of the radix cache (`radix_cache.py`), least recently used first.

An idle node is one no request or pin locks. Idle nodes sit in one LRU per tier (an OrderedDict,
oldest first) ordered so that every node comes before its idle ancestors. Because a locked node's
ancestors are locked, the first device entry has no device children and the first host entry has
no children at all: eviction takes the first entry, in O(1), without scanning for leaves. The order
is kept by appending in leaf-to-root order whenever nodes become idle or are touched.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.kv.radix_node import RadixNode

_ABSENT = object()


class IdleNodes:
    """The two LRUs and their block counts; the radix cache is their one writer."""

    def __init__(self) -> None:
        self.device: OrderedDict[RadixNode, None] = OrderedDict()
        self.host: OrderedDict[RadixNode, None] = OrderedDict()
        self.device_blocks = 0  # device blocks in idle nodes: what eviction can free
        self.host_blocks = 0

    def add(self, node: RadixNode) -> None:
        """`node` became idle: it goes to the recent end of its tier's LRU."""
        if node.blocks is not None:
            self.device[node] = None
            self.device_blocks += node.length
        else:
            self.host[node] = None
            self.host_blocks += node.length

    def remove(self, node: RadixNode) -> None:
        """`node` is locked now (a node just created by an insert is in no LRU yet)."""
        if node.blocks is not None:
            if self.device.pop(node, _ABSENT) is not _ABSENT:
                self.device_blocks -= node.length
        elif self.host.pop(node, _ABSENT) is not _ABSENT:
            self.host_blocks -= node.length

    def touch(self, node: RadixNode, root: RadixNode) -> None:
        """Move `node` and its idle ancestors to the recent end, leaf first."""
        while node is not root and node.lock == 0:
            (self.device if node.blocks is not None else self.host).move_to_end(node)
            node = node.parent

    def newest_first(self) -> list[RadixNode]:
        """Idle device nodes, then idle host nodes, each most recently used first."""
        return list(reversed(self.device)) + list(reversed(self.host))
