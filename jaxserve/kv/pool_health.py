"""What the pool tier (`pool_tier.PoolTier`) knows of its store: whether it can be reached
(`PoolHealth`) and which blocks it saw stored there (`KnownKeys`)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from jaxserve.kv.block_store import UNAVAILABLE, BlockStore
from jaxserve.kv.kv_tier import KVTierStats

logger = logging.getLogger(__name__)

KNOWN_KEYS = 1 << 16  # keys remembered as stored in the pool (writes of those are skipped)


class KnownKeys:
    """Keys this engine saw stored in the pool (written or found), least recently seen first."""

    def __init__(self, limit: int = KNOWN_KEYS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def add(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self.limit:
                self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()


class PoolHealth:
    """Whether the store can be reached: down once a call reports UNAVAILABLE, up again when a
    probe (every `probe_seconds`, on its own thread) gets an answer; `on_up` runs then."""

    def __init__(
        self, store: BlockStore, probe_key: str, probe_seconds: float, stats: KVTierStats, on_up: Callable[[], None]
    ) -> None:
        self.store = store
        self.probe_key = probe_key
        self.probe_seconds = probe_seconds
        self.stats = stats
        self.on_up = on_up
        self.down = threading.Event()
        self.stop = threading.Event()

    def check(self, results: Sequence[int]) -> None:
        """Mark the store down when a call's `results` say it could not be reached."""
        if UNAVAILABLE in results and not self.down.is_set():
            self.down.set()
            self.stats.outages += 1
            logger.warning("the KV pool cannot be reached: recomputing instead until it answers again")

    def probe_loop(self) -> None:
        while not self.stop.wait(self.probe_seconds):
            if self.down.is_set() and UNAVAILABLE not in self.store.exists([self.probe_key]):
                self.on_up()
                self.down.clear()
                logger.warning("the KV pool answers again")
