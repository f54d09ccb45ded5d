"""The prefix cache's changes as a router wants them (KV events): the content keys of blocks that
entered the cache (device or host tier) and of blocks that left it, numbered, with the set of
keys cached now for a router that (re)connects.

A router computes the same keys from a prompt (`content_keys.chain_keys` seeded with the
engine's `seed`), so the longest run of a prompt's leading keys in a worker's set is the prefix
that worker would serve from its cache: placement from what the worker holds, not from what the
router sent it. Blocks of LoRA requests are keyed under the seed salted by the adapter's weights
digest (`ChainKeys.salted`); a worker lists each adapter's digest with its adapters (the worker
API's `LoraAdaptersResponse.digests`), from which the router salts the seed the same way.

The engine thread records; another thread (the worker's gRPC service, which polls) reads
`since` and `snapshot`: one lock guards them. The log keeps the last `max_events` batches; a reader further
behind takes a snapshot instead.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class KVEventBatch:
    """One change of the cache: keys stored, keys removed, or everything cleared."""

    seq: int
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    cleared: bool = False


class KVEventLog:
    def __init__(self, seed: bytes, max_events: int = 4096) -> None:
        self.seed = seed  # the chain seed of the keys (base model)
        self._lock = threading.Lock()
        self._events: collections.deque[KVEventBatch] = collections.deque(maxlen=max_events)
        self._cached: set[bytes] = set()
        self._seq = 0

    @property
    def seq(self) -> int:
        return self._seq

    def stored(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            new = tuple(k for k in keys if k not in self._cached)
            if new:
                self._cached.update(new)
                self._append(KVEventBatch(self._seq + 1, stored=new))

    def removed(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            gone = tuple(k for k in keys if k in self._cached)
            if gone:
                self._cached.difference_update(gone)
                self._append(KVEventBatch(self._seq + 1, removed=gone))

    def cleared(self) -> None:
        with self._lock:
            if self._cached:
                self._cached.clear()
                self._append(KVEventBatch(self._seq + 1, cleared=True))

    def _append(self, batch: KVEventBatch) -> None:
        """Record a batch (lock held)."""
        self._seq = batch.seq
        self._events.append(batch)

    def snapshot(self) -> tuple[int, frozenset[bytes]]:
        """(sequence number, keys cached as of it)."""
        with self._lock:
            return self._seq, frozenset(self._cached)

    def since(self, seq: int) -> list[KVEventBatch] | None:
        """The batches after `seq` (None: some are no longer kept; take a snapshot)."""
        with self._lock:
            if seq >= self._seq:
                return []
            if not self._events or self._events[0].seq > seq + 1:
                return None
            return [e for e in self._events if e.seq > seq]
