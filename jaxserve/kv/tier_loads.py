"""Reads of cached blocks from the tier below the host tier into the host tier, while their
requests wait.

The scheduler, instead of admitting a request whose prompt continues in that tier, may `start` a
load of those blocks under the request's key; once `poll` has put them in the prefix cache it
matches and admits again (`KVCacheManager.admit(..., load_key=key)` takes the load's lock over).
Without such a tier (`NoTierLink`) nothing is ever loaded (`start` answers NONE), so callers
need not ask which they have.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from jaxserve.kv.prefix_hit import PrefixHit
from jaxserve.kv.tier_link import LoadStart, LowerTierLink


class TierLoads:
    def __init__(self, link: LowerTierLink, epoch: Callable[[], int], changed: Callable[[], None]) -> None:
        """`epoch` reads the manager's change counter (a stale hit is refused); `changed` moves it."""
        self._link = link
        self._epoch = epoch
        self._changed = changed

    def start(self, key: Hashable, hit: PrefixHit) -> LoadStart:
        """Read the hit's lower-tier blocks into the host tier in the background, instead of admitting.

        STARTED: `is_loading(key)` until a later `poll()`; then match and admit again (a match that
        still continues in the tier, when the host tier had room for part of it, may load again).
        BUSY: the in-flight bound is reached, try again later. NONE: no room; admit and recompute.
        """
        if not hit.num_disk_tokens:
            return LoadStart.NONE
        if hit.epoch != self._epoch():
            raise ValueError("stale PrefixHit: the manager changed since match_prefix; match again")
        num_blocks = hit.num_disk_tokens // self._link.block_size
        result = self._link.start_load(key, hit.path, hit.token_ids, hit.chain, num_blocks)
        if result is LoadStart.STARTED:
            self._changed()
        return result

    def submit(self) -> None:
        """Start the reads of loads begun since the last call: call it after the copies taken
        with `take_copies` have run (the runner's launch), or when there were none."""
        self._link.submit()

    def poll(self) -> bool:
        """Put finished loads into the prefix cache; True if any finished."""
        if not self._link.poll():
            return False
        self._changed()
        return True

    def is_loading(self, key: Hashable) -> bool:
        return self._link.is_loading(key)

    @property
    def pending(self) -> bool:
        """Some load has not been put into the prefix cache yet."""
        return self._link.has_pending

    def cancel(self, key: Hashable) -> None:
        """The request went away: release what its load holds (a no-op if it has none)."""
        self._changed()
        self._link.release(key, 0)
