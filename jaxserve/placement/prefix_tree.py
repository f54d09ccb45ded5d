"""An approximate picture of one target's prefix cache, built from the prompts placed there.

As SGLang's cache-aware router does, a placer that cannot ask a target what it holds (a worker
process) inserts each prompt it sends there into that target's tree, and the longest match of a new
prompt says how much of it the target probably has cached. The tree is a radix tree over token ids,
capped at `max_tokens` tokens: past the cap the least recently used leaves go, as a target's LRU
cache evicts its own. A target that restarts has its tree cleared (see `SentPrefixes`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("key", "children", "parent", "last_used")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key  # the tokens on the edge from the parent
        self.children: dict[int, _Node] = {}  # first token of the child's key -> child
        self.parent = parent
        self.last_used = 0


def _common(a: tuple[int, ...], b: Sequence[int], start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class ApproxPrefixTree:
    def __init__(self, max_tokens: int = 1 << 20) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._root = _Node((), None)
        self._clock = itertools.count(1)

    def match(self, ids: Sequence[int]) -> int:
        """Tokens of `ids` from the start that the tree holds (marks the path recently used)."""
        node, pos, now = self._root, 0, next(self._clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common(child.key, ids, pos)
            child.last_used = now
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, ids: Sequence[int]) -> None:
        node, pos, now = self._root, 0, next(self._clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(tuple(ids[pos:]), node)
                leaf.last_used = now
                node.children[ids[pos]] = leaf
                self.num_tokens += len(leaf.key)
                break
            n = _common(child.key, ids, pos)
            if n < len(child.key):  # split the edge at n
                head = _Node(child.key[:n], node)
                node.children[ids[pos]] = head
                child.key = child.key[n:]
                child.parent = head
                head.children[child.key[0]] = child
                child = head
            child.last_used = now
            pos += n
            node = child
        if self.num_tokens > self.max_tokens:
            self._evict(self.max_tokens * 9 // 10)

    def clear(self) -> None:
        self._root = _Node((), None)
        self.num_tokens = 0

    def _evict(self, target: int) -> None:
        """Drop least recently used leaves (and the parents they leave childless) to `target` tokens."""
        tie = itertools.count()
        heap = [(leaf.last_used, next(tie), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while heap and self.num_tokens > target:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.num_tokens -= len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_used, next(tie), parent))

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                out.append(node)
        return out
