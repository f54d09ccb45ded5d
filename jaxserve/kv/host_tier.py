"""Host-memory slots for KV blocks that left the device.

Two kinds of holders use these slots, one holder per slot:
- a swapped-out request (its whole block table was copied device -> host on preemption and is
  copied back host -> device when it resumes), and
- the prefix cache, whose blocks evicted from the device may "spill" here and come back on a
  later hit instead of being recomputed (the SGLang HiCache / Mooncake idea).

This class only allocates slot numbers and has its own capacity. The copies themselves are
planned by `KVCacheManager` / `RadixCache` into a `CopyPlan` and executed by the runner, which
owns the host buffers (e.g. numpy arrays of shape [num_layers, 2, num_slots, ...]).
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.kv.block_pool import NoFreeBlocksError


class HostTier:
    """`num_slots` host slots, each the size of one device KV block."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._in_use = bytearray(num_slots)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        free = self._free
        if n > len(free):
            raise NoFreeBlocksError(f"asked for {n} host slots, {len(free)} free")
        if n <= 0:
            return []
        taken = free[-n:]
        del free[-n:]
        taken.reverse()
        in_use = self._in_use
        for slot in taken:
            in_use[slot] = 1
        return taken

    def free(self, slots: Iterable[int]) -> None:
        in_use = self._in_use
        for slot in slots:
            if not in_use[slot]:
                raise ValueError(f"host slot {slot} freed twice")
            in_use[slot] = 0
            self._free.append(slot)

    def is_in_use(self, slot: int) -> bool:
        return bool(self._in_use[slot])

    def check_integrity(self, held: Iterable[int] | None = None) -> None:
        """Free xor in use; `held` (all holders' slots), if given, must be exactly the used set."""
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("a host slot is on the free list twice")
        for slot in free:
            if self._in_use[slot]:
                raise AssertionError(f"host slot {slot} is both free and in use")
        if len(free) + sum(self._in_use) != self.num_slots:
            raise AssertionError("host slots lost: neither free nor in use")
        if held is not None:
            held = list(held)
            if len(set(held)) != len(held):
                raise AssertionError("a host slot has two holders")
            used = {slot for slot in range(self.num_slots) if self._in_use[slot]}
            if set(held) != used:
                raise AssertionError(f"host slots in use {sorted(used)[:8]}... differ from held {sorted(held)[:8]}...")
