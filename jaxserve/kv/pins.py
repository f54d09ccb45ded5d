"""Pins: a session keeps the cached blocks of its latest history from being evicted.

A pin locks a token path in the prefix cache on behalf of an owner (an API key). Pinned blocks
are counted per owner against a budget, and all pins together against a pool-wide cap, so one
owner cannot pin the whole pool and sessions together cannot starve running requests.
Accounting is per pin: two pins of one owner that share a prefix both count the shared blocks
(simple and conservative).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from jaxserve.kv.radix_cache import RadixNode


@dataclass(eq=False)
class Pin:
    """A handle returned by `KVCacheManager.pin`; pass it to `unpin`."""

    owner: Hashable
    num_blocks: int          # blocks of the pinned path (counted against the owner's budget)
    num_tokens: int          # tokens of the pinned path (a multiple of the block size)
    node: RadixNode | None = field(repr=False, default=None)
    active: bool = True


class PinLedger:
    """Per-owner and total counts of pinned blocks, with their limits."""

    def __init__(self, budget_per_owner: int, max_total: int) -> None:
        if budget_per_owner < 0 or max_total < 0:
            raise ValueError("pin budgets must be >= 0")
        self.budget_per_owner = budget_per_owner
        self.max_total = max_total
        self.total = 0
        self._by_owner: dict[Hashable, int] = {}
        self._pins: set[Pin] = set()

    def pinned_by(self, owner: Hashable) -> int:
        return self._by_owner.get(owner, 0)

    def fits(self, owner: Hashable, num_blocks: int, replacing: Pin | None = None) -> bool:
        """Would a pin of `num_blocks` for `owner` fit both limits, once `replacing` is gone?"""
        same_owner = replacing is not None and replacing.owner == owner
        freed_owner = replacing.num_blocks if same_owner else 0
        freed_total = replacing.num_blocks if replacing is not None else 0
        return (self.pinned_by(owner) - freed_owner + num_blocks <= self.budget_per_owner
                and self.total - freed_total + num_blocks <= self.max_total)

    def add(self, pin: Pin) -> None:
        self._pins.add(pin)
        if pin.num_blocks:
            self._by_owner[pin.owner] = self.pinned_by(pin.owner) + pin.num_blocks
        self.total += pin.num_blocks

    def remove(self, pin: Pin) -> None:
        if not pin.active or pin not in self._pins:
            raise ValueError("unpin of a pin that is not active")
        self._pins.remove(pin)
        pin.active = False
        left = self.pinned_by(pin.owner) - pin.num_blocks
        if left:
            self._by_owner[pin.owner] = left
        else:
            self._by_owner.pop(pin.owner, None)
        self.total -= pin.num_blocks

    def pins(self) -> list[Pin]:
        return list(self._pins)

    def holds(self, pin: Pin) -> bool:
        """Is `pin` one of this ledger's (not another pool's) active pins?"""
        return pin in self._pins

    def check_integrity(self) -> None:
        by_owner: dict[Hashable, int] = {}
        for pin in self._pins:
            if not pin.active:
                raise AssertionError("inactive pin in the ledger")
            by_owner[pin.owner] = by_owner.get(pin.owner, 0) + pin.num_blocks
        by_owner = {owner: n for owner, n in by_owner.items() if n}
        if by_owner != self._by_owner or sum(by_owner.values()) != self.total:
            raise AssertionError("pin accounting does not match the pins")
