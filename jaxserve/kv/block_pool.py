"""Physical KV blocks on the device: reference counts and an O(1) free list.

A block is either free (reference count 0, on the free list) or referenced (count >= 1), never
both. The holders are request block tables (one reference per table that lists the block) and
the prefix cache (one reference on every device block it stores). The pool only counts; who
holds what is the business of `KVCacheManager` and `RadixCache`.

Block 0 is reserved and never handed out: padded batch entries point at it, so the writes of
padding land somewhere harmless.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

RESERVED_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free. Callers check capacity first."""


class BlockPool:
    """`num_blocks` blocks of `block_size` KV slots; block 0 is reserved."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount: list[int] = [0] * num_blocks
        # A stack: pop() hands out low ids first on a fresh pool, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, RESERVED_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be handed out (all but the reserved one)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with one reference."""
        free = self._free
        if n > len(free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(free)} free")
        if n <= 0:
            return []
        taken = free[-n:]
        del free[-n:]
        taken.reverse()
        refcount = self.refcount
        for block in taken:
            refcount[block] = 1
        return taken

    def incref(self, block: int) -> None:
        if self.refcount[block] <= 0:
            raise ValueError(f"incref of block {block}, which is not allocated")
        self.refcount[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; returns True when that freed the block."""
        refcount = self.refcount
        count = refcount[block]
        if count <= 0:
            raise ValueError(f"decref of block {block}, which is not allocated (double free?)")
        refcount[block] = count - 1
        if count == 1:
            self._free.append(block)
            return True
        return False

    def decref_all(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.decref(block)

    def is_free(self, block: int) -> bool:
        return block != RESERVED_BLOCK and self.refcount[block] == 0

    def check_integrity(self, expected_refcount: Sequence[int] | None = None) -> None:
        """Free xor referenced, block 0 untouched, and (if given) counts equal to the holders."""
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        if RESERVED_BLOCK in set(free) or self.refcount[RESERVED_BLOCK] != 0:
            raise AssertionError("reserved block 0 was handed out")
        free_set = set(free)
        for block in range(1, self.num_blocks):
            count = self.refcount[block]
            if count < 0:
                raise AssertionError(f"block {block} has refcount {count}")
            if (count == 0) != (block in free_set):
                raise AssertionError(f"block {block}: refcount {count} but on free list = {block in free_set}")
        if expected_refcount is not None:
            for block in range(self.num_blocks):
                if self.refcount[block] != expected_refcount[block]:
                    raise AssertionError(
                        f"block {block}: refcount {self.refcount[block]} but {expected_refcount[block]} holders"
                    )
