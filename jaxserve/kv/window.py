"""Sliding-window KV: a model whose every attention layer attends only to the last `window` tokens
(Mistral's `sliding_window`) keeps a window-sized cache.

A query at position p reads keys at positions > p - window (every attention backend masks the
same way). Once the sequence's next query is at `start` or later, a block whose last position is
<= start - window is read by no later step, so the sequence lets it go: its table entry becomes
`RESERVED_BLOCK` (a position no kernel reads, as padded table entries already are) and its
reference is released. Steps already launched still read such a block, but any step that writes a
block this frees runs on the device after them (the cache is threaded through the steps), so it can
go back to the pool at once.

A dropped block that the prefix cache also holds stays in the cache, kept (locked) on the
sequence's cached path while the sequence holds any block of that path; once every cached block of
the sequence is dropped, the lock goes too and they become evictable like any idle cached block.
The scheduler caches only a sliding-window request's prompt blocks (not its output), so a long
decode ends up holding only its window.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxserve.kv.block_pool import RESERVED_BLOCK, BlockPool
from jaxserve.kv.block_table import KVHandle
from jaxserve.kv.prefix_cache import PrefixCache


class SlidingWindow:
    """The KV manager's sliding window (`KVCacheManager.window`): `size` tokens, or None (`enabled`
    False) for a model that attends to every token it has (each sequence keeps every block)."""

    def __init__(self, size: int | None, pool: BlockPool, cache: PrefixCache, changed: Callable[[], None]) -> None:
        if size is not None and size < 1:
            raise ValueError(f"sliding_window must be >= 1, got {size}")
        self.size = size
        self._pool, self._cache, self._changed = pool, cache, changed

    @property
    def enabled(self) -> bool:
        return self.size is not None

    def slide(self, handle: KVHandle, start: int) -> None:
        """Queries of the sequence from position `start` on (its next step's first one, or later)
        read only the window: release the blocks before it (`drop_out_of_window`). Nothing when
        disabled."""
        if self.size is None:
            return
        if not handle.is_live or handle.host_slots is not None:
            raise ValueError("the sequence is not on the device (freed or swapped out)")
        if drop_out_of_window(handle, start, self.size, self._pool, self._cache):
            self._changed()  # cached blocks may have become evictable: prefix hits made before are stale


def first_needed_block(window: int, block_size: int, start: int) -> int:
    """The first block a query at `start` or later reads (the blocks before it end at or before
    `start - window`)."""
    return max(0, (start - window + 1) // block_size)


def drop_out_of_window(handle: KVHandle, start: int, window: int, pool: BlockPool, cache: PrefixCache) -> bool:
    """Release the sequence's blocks that no query at `start` or later reads; True if any was
    released. When none of its cached blocks is held any more, its cached path is unlocked
    (`cached_blocks` 0): the cache has those blocks to evict, and the sequence caches nothing more."""
    end = min(first_needed_block(window, handle.block_size, start), handle.num_blocks)
    if end <= handle.num_dropped:
        return False
    pool.decref_all(handle.table[handle.num_dropped : end].tolist())
    handle.table[handle.num_dropped : end] = RESERVED_BLOCK
    handle.num_dropped = end
    handle.renew_version()
    if handle.cached_blocks and end >= handle.cached_blocks:
        cache.unlock(handle.path)
        handle.path = cache.root
        handle.cached_blocks = 0
    return True
