"""A sequence's KV handle: its block table and what the KV manager knows of it.

The request owns its handle (`Request.kv`); the KV manager makes it (`admit`) and edits it
(growth, caching, swap, `free`); the runner reads its table. Vocabulary: the
handle's *KV slots* are the token positions it has KV space for: tokens computed plus those
being computed by the step being scheduled. The KV slot of position p is
`table[p // block_size] * block_size + p % block_size`.

With a sliding window (`window.py`) the first `num_dropped` entries are `RESERVED_BLOCK`: blocks
wholly before the window, released; the attention kernels never read those positions.
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxserve.kv.content_keys import ChainKeys
from jaxserve.kv.prefix_cache import CachedPath

_versions = itertools.count(1)


def next_table_version() -> int:
    """A table version never used before (by any handle of this process)."""
    return next(_versions)


class KVHandle:
    __slots__ = (
        "block_size",
        "table",
        "_readonly",
        "num_blocks",
        "version",
        "num_tokens",
        "path",
        "cached_blocks",
        "host_slots",
        "chain",
        "is_live",
        "state_slot",
        "num_dropped",
    )

    def __init__(
        self,
        block_size: int,
        blocks: list[int],
        num_tokens: int,
        path: CachedPath,
        cached_blocks: int,
        chain: ChainKeys | None,
    ) -> None:
        self.block_size = block_size
        self.table = np.empty(max(2 * len(blocks), 8), dtype=np.int32)  # [:num_blocks] valid
        self.table[: len(blocks)] = blocks
        self._readonly = _readonly(self.table)
        self.num_blocks = len(blocks)
        self.version = next_table_version()
        self.num_tokens = num_tokens
        self.path = path  # the locked prefix-cache path of [:cached_blocks]
        self.cached_blocks = cached_blocks
        self.host_slots: list[int] | None = None  # set while swapped out
        self.chain = chain  # content keys of its blocks (the disk tier's write-through)
        self.is_live = True  # until `KVCacheManager.free`
        self.state_slot: int | None = None  # a hybrid model's (`state_slots.py`), from admission to `free`
        self.num_dropped = 0  # leading entries released as out of the sliding window (`window.py`)

    @property
    def block_table(self) -> np.ndarray:
        """Read-only int32 view of the sequence's blocks (empty while swapped out)."""
        return self._readonly[: self.num_blocks]

    @property
    def held_blocks(self) -> np.ndarray:
        """Read-only view of the blocks the sequence holds a reference on (the table after its
        dropped entries; empty while swapped out)."""
        return self._readonly[self.num_dropped : self.num_blocks] if self.num_blocks else self._readonly[:0]

    @property
    def may_cache_more(self) -> bool:
        """Whether blocks after its cached ones may still join the prefix cache: not once the
        sliding window dropped one of them (its KV is gone from the table)."""
        return self.num_dropped <= self.cached_blocks

    def kv_slots(self, start: int, stop: int) -> np.ndarray:
        """int32 KV slots of token positions [start, stop) (the handle must be on the device)."""
        if self.host_slots is not None:
            raise ValueError("the sequence is swapped out; swap it in first")
        if not 0 <= start <= stop <= self.num_tokens:
            raise ValueError(f"positions [{start}, {stop}) outside the sequence's {self.num_tokens} KV slots")
        bs = self.block_size
        block = start // bs
        if start == stop:
            return np.empty(0, dtype=np.int32)
        if stop - 1 < (block + 1) * bs:  # within one block (every decode): no gather
            base = int(self.table[block]) * bs - block * bs
            return np.arange(base + start, base + stop, dtype=np.int32)
        positions = np.arange(start, stop, dtype=np.int32)
        return self.table[positions // bs] * bs + positions % bs

    def append(self, blocks: list[int]) -> None:
        end = self.num_blocks + len(blocks)
        if end > len(self.table):
            grown = np.empty(max(2 * len(self.table), end), dtype=np.int32)
            grown[: self.num_blocks] = self.table[: self.num_blocks]
            self.table, self._readonly = grown, _readonly(grown)
        self.table[self.num_blocks : end] = blocks
        self.num_blocks = end

    def renew_version(self) -> None:
        """Entries of the table changed (not just appended): copies of it are stale."""
        self.version = next_table_version()


def _readonly(table: np.ndarray) -> np.ndarray:
    view = table.view()
    view.flags.writeable = False
    return view
