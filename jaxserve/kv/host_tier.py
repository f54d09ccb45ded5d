"""Host-memory host slots for KV blocks that left the device.

Two kinds of holders use these host slots, one holder per host slot:
- a swapped-out request (its whole block table was copied device -> host on preemption and is
  copied back host -> device when it resumes), and
- the prefix cache, whose blocks evicted from the device may "spill" here and come back on a
  later hit instead of being recomputed (the SGLang HiCache / Mooncake idea).

This class only allocates host slot numbers and has its own capacity. The copies themselves are
planned by `KVCacheManager` / `RadixCache` into a `CopyPlan` and executed by the runner, which
owns the host buffers (e.g. numpy arrays of shape [num_layers, 2, num_host_slots, ...]).
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.kv.block_pool import NoFreeBlocksError


class HostTier:
    """`num_host_slots` host slots, each the size of one device KV block."""

    def __init__(self, num_host_slots: int) -> None:
        if num_host_slots < 0:
            raise ValueError(f"num_host_slots must be >= 0, got {num_host_slots}")
        self.num_host_slots = num_host_slots
        self._in_use = bytearray(num_host_slots)
        self._free: list[int] = list(range(num_host_slots - 1, -1, -1))

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
        for host_slot in taken:
            in_use[host_slot] = 1
        return taken

    def free(self, host_slots: Iterable[int]) -> None:
        in_use = self._in_use
        for host_slot in host_slots:
            if not in_use[host_slot]:
                raise ValueError(f"host slot {host_slot} freed twice")
            in_use[host_slot] = 0
            self._free.append(host_slot)

    def is_in_use(self, host_slot: int) -> bool:
        return bool(self._in_use[host_slot])

    def check_integrity(self, held: Iterable[int] | None = None) -> None:
        """Free xor in use; `held` (all holders' host slots), if given, must be exactly the used set."""
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("a host slot is on the free list twice")
        for host_slot in free:
            if self._in_use[host_slot]:
                raise AssertionError(f"host slot {host_slot} is both free and in use")
        if len(free) + sum(self._in_use) != self.num_host_slots:
            raise AssertionError("host slots lost: neither free nor in use")
        if held is not None:
            held = list(held)
            if len(set(held)) != len(held):
                raise AssertionError("a host slot has two holders")
            used = {host_slot for host_slot in range(self.num_host_slots) if self._in_use[host_slot]}
            if set(held) != used:
                raise AssertionError(f"host slots in use {sorted(used)[:8]}... differ from held {sorted(held)[:8]}...")
