"""Leases: cached blocks kept on behalf of someone other than a running request.

A lease locks a path of the prefix cache so that its blocks are not evicted. Two kinds:

- a **pin** keeps a session's latest history for the next turn. Pins are counted per owner (an
  API key) against a budget, and all pins together against a pool-wide cap, so one owner cannot
  pin the whole pool and sessions together cannot starve running requests. Accounting is per
  pin: two pins of one owner that share a prefix both count the shared blocks (simple and
  conservative).
- a **hold** keeps a prompt's device blocks while they move between workers (prefill/decode
  disaggregation): the prefill side holds them until the decode side has read them; the decode
  side holds what it had while it pulls the rest, writes the pulled KV into blocks it allocates
  (`allocate_import`), adds them to the cache (`adopt_import`) and keeps the longer path held
  until the request is admitted. A hold counts against no budget: it lives seconds.

Loads from the tier below the host tier (`tier_link`) lock paths too, with host slots, while blocks are read.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.kv.block_pool import BlockPool
from jaxserve.kv.prefix_cache import CachedPath, PrefixCache


@dataclass(eq=False)
class CacheLease:
    """Cached blocks kept until released (the path they are on stays with `Leases`)."""

    active: bool = field(default=True, kw_only=True)


@dataclass(eq=False)
class Pin(CacheLease):
    """A session's pinned history: pass it back to `unpin` or to the next `pin_within_budget`."""

    owner: Hashable
    num_blocks: int  # blocks of the pinned path (counted against the owner's budget)
    num_tokens: int  # tokens of the pinned path (a multiple of the block size)


@dataclass(eq=False)
class Hold(CacheLease):
    """Held device blocks: `blocks` hold the KV of the first `len(blocks) * block_size` tokens of
    the prompt the hold was made for."""

    blocks: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class Leases:
    """The pins and holds of one KV cache, with the pins' budgets."""

    def __init__(
        self,
        cache: PrefixCache,
        pool: BlockPool,
        budget_per_owner: int,
        max_pinned: int,
        changed: Callable[[], None],
    ) -> None:
        """`changed` is called before every change of the cache's locks (it invalidates prefix hits)."""
        if budget_per_owner < 0 or max_pinned < 0:
            raise ValueError("pin budgets must be >= 0")
        self.cache = cache
        self.pool = pool
        self.budget_per_owner = budget_per_owner
        self.max_pinned = max_pinned
        self.num_pinned = 0
        self._changed = changed
        self._pinned_by: dict[Hashable, int] = {}
        self._pins: dict[Pin, CachedPath] = {}  # each active pin and the path it locks
        self._holds: dict[Hold, CachedPath] = {}

    # ------------------------------------------------------------------ pins

    def pinned_by(self, owner: Hashable) -> int:
        return self._pinned_by.get(owner, 0)

    def pins(self) -> list[Pin]:
        return list(self._pins)

    def holds_pin(self, pin: Pin) -> bool:
        """Is `pin` one of this cache's (not another replica's) active pins?"""
        return pin in self._pins

    def _fits(self, owner: Hashable, num_blocks: int, replacing: Pin | None) -> bool:
        """Would a pin of `num_blocks` for `owner` fit both limits, once `replacing` is gone?"""
        freed_total = replacing.num_blocks if replacing is not None else 0
        freed_owner = freed_total if replacing is not None and replacing.owner == owner else 0
        return (
            self.pinned_by(owner) - freed_owner + num_blocks <= self.budget_per_owner
            and self.num_pinned - freed_total + num_blocks <= self.max_pinned
        )

    def pin(
        self, owner: Hashable, token_ids: Sequence[int] | np.ndarray, *, replacing: Pin | None = None
    ) -> Pin | None:
        """Keep the cached full blocks of `token_ids` from eviction, for `owner`.

        Pins what is cached now (on either tier). Returns None, with nothing changed, if it would
        exceed the owner's budget or the pool-wide cap. `replacing` (a pin to release at the same
        time, e.g. a session's previous history) does not count against the budget.
        """
        if replacing is not None and not replacing.active:
            raise ValueError("replacing a pin that is not active")
        match = self.cache.match(token_ids, leave_last_token=False)
        num_blocks = match.num_blocks
        if not self._fits(owner, num_blocks, replacing):
            return None
        pin = Pin(owner, num_blocks, num_blocks * self.pool.block_size)
        self._lock(self._pins, pin, match.path)
        if num_blocks:
            self._pinned_by[owner] = self.pinned_by(owner) + num_blocks
        self.num_pinned += num_blocks
        if replacing is not None:
            self.unpin(replacing)
        return pin

    def pin_within_budget(
        self, owner: Hashable, token_ids: Sequence[int], old: Pin | None, others: list[Pin]
    ) -> tuple[Pin | None, list[Pin]]:
        """Pin `token_ids` for `owner` replacing `old` (a session's previous history), unpinning
        `others` (the owner's other pins, least recently used first) as needed to fit its budget.
        Returns the new pin (None if even alone it does not fit) and the pins released. Pins in
        `others` that this cache does not hold (another replica's) are left alone."""
        others = [p for p in others if p in self._pins]
        if old is not None and not old.active:
            old = None
        released = []
        pin = self.pin(owner, token_ids, replacing=old)
        if pin is None and others:
            needed = self.cache.match(token_ids, leave_last_token=False).num_blocks
            if needed <= self.budget_per_owner:  # else hopeless even alone: keep the others
                for other in others:
                    if not other.active:
                        continue
                    self.unpin(other)
                    released.append(other)
                    pin = self.pin(owner, token_ids, replacing=old)
                    if pin is not None:
                        break
        if pin is None and old is not None:
            self.unpin(old)  # the old history is stale now; do not keep it pinned either
            released.append(old)
        return pin, released

    def unpin(self, pin: Pin) -> None:
        if not pin.active or pin not in self._pins:
            raise ValueError("unpin of a pin that is not active")
        left = self.pinned_by(pin.owner) - pin.num_blocks
        if left:
            self._pinned_by[pin.owner] = left
        else:
            self._pinned_by.pop(pin.owner, None)
        self.num_pinned -= pin.num_blocks
        self._unlock(self._pins, pin)

    # ------------------------------------------------------------------ holds

    def hold_prefix(self, token_ids: Sequence[int] | np.ndarray, max_blocks: int | None = None) -> Hold:
        """Hold the cached device blocks that start `token_ids` (its full blocks, at most
        `max_blocks`): not evicted until `release_hold`. Blocks spilled to the host are left out
        (they follow the device ones). Empty without prefix caching."""
        cache = self.cache
        n = len(token_ids) if max_blocks is None else min(len(token_ids), max_blocks * self.pool.block_size)
        path = cache.device_prefix(cache.match(token_ids[:n], leave_last_token=False).path)
        hold = Hold(cache.path_blocks(path))
        self._lock(self._holds, hold, path)
        return hold

    def release_hold(self, hold: Hold) -> None:
        if not hold.active or hold not in self._holds:
            raise ValueError("release of a hold that is not active")
        self._unlock(self._holds, hold)

    def adopt_import(self, hold: Hold, token_ids: Sequence[int] | np.ndarray, blocks: list[int]) -> Hold:
        """Add `blocks` (KV written: see `KVCacheManager.allocate_import`) to the prefix cache
        after the path `hold` holds: blocks[i] has the KV of block `hold.num_blocks + i` of
        `token_ids`. Returns a hold of the longer path, which replaces `hold`. Blocks whose
        tokens the cache has already go back to the pool."""
        if not hold.active:
            raise ValueError("adopt_import after a hold that is not active")
        bs, first = self.pool.block_size, hold.num_blocks
        self._changed()
        tokens = token_ids[first * bs : (first + len(blocks)) * bs]
        result = self.cache.insert(tokens, blocks, parent=self._holds[hold])
        if len(result.blocks) < len(blocks):  # (the cache of an engine with prefix caching off)
            self.cache.unlock(result.path)
            raise ValueError("imported blocks go into the prefix cache: enable it")
        self.pool.decref_all(blocks)
        longer = Hold(hold.blocks + result.blocks)
        self._holds[longer] = result.path  # `insert` locked it
        self.release_hold(hold)
        return longer

    # ------------------------------------------------------------------ all leases

    def locked_paths(self) -> list[CachedPath]:
        """The path of every active lease (a path locked twice appears twice)."""
        return [*self._pins.values(), *self._holds.values()]

    def _lock(self, leases: dict, lease: CacheLease, path: CachedPath) -> None:
        self._changed()
        self.cache.lock(path)
        leases[lease] = path

    def _unlock(self, leases: dict, lease: CacheLease) -> None:
        self._changed()
        lease.active = False
        self.cache.unlock(leases.pop(lease))

    def check_integrity(self) -> None:
        by_owner: dict[Hashable, int] = {}
        for pin in self._pins:
            if not pin.active:
                raise AssertionError("inactive pin in the ledger")
            by_owner[pin.owner] = by_owner.get(pin.owner, 0) + pin.num_blocks
        by_owner = {owner: n for owner, n in by_owner.items() if n}
        if by_owner != self._pinned_by or sum(by_owner.values()) != self.num_pinned:
            raise AssertionError("pin accounting does not match the pins")
        if any(not hold.active for hold in self._holds):
            raise AssertionError("inactive hold among the holds")
