"""The draft model's own KV blocks (host bookkeeping, no JAX): per request, its block table in the draft's
cache and how many of its tokens the draft has computed there.

The draft's cache is a pool of its own (`BlockPool`), separate from the target's: the target's scheduler
never sees it, and a request's draft blocks go when the scheduler releases the request (`free`). A request
that finds no free draft blocks is simply not drafted for this step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.kv.block_pool import BlockPool
from jaxserve.request import Request


@dataclasses.dataclass
class DraftSequence:
    """A request in the draft's cache: `blocks` hold positions [0, len(blocks) * block_size), and the K/V
    of its first `num_computed` tokens are valid (later slots hold drafts that may have been rejected)."""

    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0


class DraftKV:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.sequences: dict[Request, DraftSequence] = {}

    def reserve(self, req: Request, num_positions: int) -> DraftSequence | None:
        """The request's draft sequence with blocks for `num_positions` positions, or None (nothing taken)
        when the pool has too few free blocks."""
        seq = self.sequences.get(req) or DraftSequence()
        need = -(-num_positions // self.block_size) - len(seq.blocks)
        if need > self.pool.num_free:
            return None
        seq.blocks += self.pool.allocate(need)
        self.sequences[req] = seq
        return seq

    def free(self, req: Request) -> None:
        """The request's draft blocks back to the pool (nothing if it has none)."""
        seq = self.sequences.pop(req, None)
        if seq is not None:
            self.pool.decref_all(seq.blocks)

    def table(self, seq: DraftSequence, width: int) -> np.ndarray:
        """The sequence's block table padded with block 0 (reserved, never read past its length) to `width`."""
        table = np.zeros(width, np.int32)
        table[: len(seq.blocks)] = seq.blocks
        return table

    @property
    def num_used(self) -> int:
        return self.pool.num_usable - self.pool.num_free
