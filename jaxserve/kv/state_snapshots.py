"""Snapshots of a hybrid model's per-sequence state at block boundaries, for prefix reuse.

A prefix-cache hit on a hybrid (Gated DeltaNet layers) needs more than the hit's KV blocks: the
linear-attention state after the hit's last token. A snapshot is that state, copied into a state
slot of its own (`state_slots.py`) when a sequence's computed tokens end on a block boundary
(the scheduler ends a prompt chunk at its last one), and kept under the content key of the prefix's
last block (`content_keys.ChainKeys`: one key names the whole prefix, as the radix cache's node
path does). A hit is then cut to the deepest block boundary that has a snapshot, and admission
copies that snapshot into the sequence's own slot (`CopyKind.STATE`): its computation resumes there.

Snapshots are evicted least recently used first, when more than `capacity` are kept or when a
sequence needs a slot and none is free. A snapshot stays valid after its blocks leave the radix
cache (it depends on the tokens alone): a hit is only ever as long as both.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from jaxserve.kv.block_table import KVHandle
from jaxserve.kv.content_keys import ChainKeys
from jaxserve.kv.copy_plan import CopyKind, CopyPlan
from jaxserve.kv.prefix_cache import PrefixCache, PrefixMatch
from jaxserve.kv.prefix_hit import PrefixHit
from jaxserve.kv.state_slots import StateSlots


class StateSnapshots:
    """The KV manager's snapshots (`KVCacheManager.snapshots`): it gives sequences their state slots
    through `take_slot`; the scheduler keeps snapshots with `save`."""

    def __init__(self, slots: StateSlots, capacity: int, copies: CopyPlan, changed: Callable[[], None]) -> None:
        """`slots`: the KV manager's state slots, which sequences share; `capacity`: snapshots kept at most
        (0: none, prefix hits of a hybrid are then impossible); `copies`: the manager's copy plan;
        `changed`: called when a snapshot is kept or dropped (a prefix hit may have changed)."""
        self.slots = slots
        self.capacity = capacity
        self.copies = copies
        self.changed = changed
        self._by_key: OrderedDict[bytes, int] = OrderedDict()  # prefix key -> its slot, least recent first

    def take_slot(self, handle: KVHandle, hit: PrefixHit) -> None:
        """Give an admitted sequence its state slot (a snapshot evicted if none is free), with the hit's
        snapshot copied into it (the hit was cut to one: `cut_to_snapshot`)."""
        resume = self.use(hit.chain.keys(hit.token_ids, hit.match.num_blocks)[-1]) if hit.num_tokens else 0
        if not self.slots.num_free:
            self.evict_one()
        handle.state_slot = self.slots.allocate()
        if resume and resume != handle.state_slot:  # (the same slot: the snapshot evicted for it, its state kept)
            self.copies.add(CopyKind.STATE, resume, handle.state_slot)

    def save(self, handle: KVHandle, token_ids: Sequence[int] | np.ndarray, num_blocks: int) -> None:
        """Keep a sequence's state, computed (or being computed by the launched step) up to the block
        boundary `num_blocks` of `token_ids`, as the snapshot of that prefix."""
        slot = self.add(handle.chain.keys(token_ids, num_blocks)[-1]) if handle.chain else None
        if slot is not None:
            self.copies.add(CopyKind.STATE, handle.state_slot, slot)
            self.changed()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def num_held(self) -> int:
        return len(self._by_key)

    def deepest(self, keys: list[bytes]) -> int:
        """Blocks of the longest prefix with a snapshot among `keys` (of blocks 0, 1, ...; 0: none)."""
        for blocks in range(len(keys), 0, -1):
            if keys[blocks - 1] in self._by_key:
                return blocks
        return 0

    def use(self, key: bytes) -> int:
        """The slot of the snapshot of prefix `key`, now the most recently used."""
        self._by_key.move_to_end(key)
        return self._by_key[key]

    def add(self, key: bytes) -> int | None:
        """A slot to copy the snapshot of prefix `key` into (evicting the least recently used if need
        be), or None: kept already, or no slot to spare."""
        if not self.enabled or key in self._by_key:
            return None
        if self.num_held >= self.capacity or not self.slots.num_free:
            if not self.evict_one():
                return None
        slot = self.slots.allocate()
        self._by_key[key] = slot
        return slot

    def evict_one(self) -> bool:
        """Drop the least recently used snapshot, freeing its slot; False if there is none."""
        if not self._by_key:
            return False
        self.slots.free(self._by_key.popitem(last=False)[1])
        self.changed()
        return True

    def held_slots(self) -> list[int]:
        return list(self._by_key.values())


def cut_to_snapshot(
    snapshots: StateSnapshots,
    cache: PrefixCache,
    match: PrefixMatch,
    token_ids: Sequence[int] | np.ndarray,
    chain: ChainKeys,
) -> PrefixMatch:
    """`match` cut to its deepest block boundary with a snapshot (a hybrid can resume only there)."""
    if not match.num_blocks:
        return match
    blocks = snapshots.deepest(chain.keys(token_ids, match.num_blocks))
    return match if blocks == match.num_blocks else cache.match(token_ids[: blocks * match.block_size + 1])
