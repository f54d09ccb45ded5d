"""State slots: a hybrid model's per-sequence places for its linear-attention layers' fixed-size
state (the Gated DeltaNet conv and recurrent states), one per running or swapped-out sequence.

The KV manager owns them beside the blocks: a sequence gets one at admission (`KVHandle.state_slot`;
none free: not admitted) and gives it back when it is freed (finished, aborted or preempted to
recompute); a swapped-out sequence keeps its slot, its state staying on the device. Slot 0 is
reserved, as block 0 is: padding sequences of a step read and write it. A model without such
layers has none (`num_slots` 0) and its sequences hold no slot.
"""

from __future__ import annotations

RESERVED_SLOT = 0


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        """`num_slots` including the reserved slot 0 (0: the model keeps no per-sequence state)."""
        if num_slots == 1 or num_slots < 0:
            raise ValueError(f"num_slots must be 0 or at least 2 (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, RESERVED_SLOT, -1))  # pops the lowest first
        self._held: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise ValueError("no free state slot")
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._held:
            raise ValueError(f"state slot {slot} is not held")
        self._held.remove(slot)
        self._free.append(slot)

    def check_integrity(self, held: list[int]) -> None:
        """Each slot is free xor held by exactly one of the live sequences' `held` (AssertionError)."""
        if sorted(held) != sorted(self._held) or len(set(held)) != len(held):
            raise AssertionError(f"state slots held {sorted(self._held)}, by sequences {sorted(held)}")
        if self._held & set(self._free) or len(self._held) + len(self._free) != max(self.num_slots - 1, 0):
            raise AssertionError("a state slot is both free and held, or lost")
