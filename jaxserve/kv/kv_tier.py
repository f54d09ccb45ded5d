"""The interface of a KV tier below the host tier (`KVTier`), and what it shares with its users.

A lower tier stores KV blocks by content key (`content_keys.py`: a block's key covers its tokens,
every token before it and the fingerprint of the model and cache layout), so another engine, or
the next start, finds the same block under the same key. It moves bytes only between itself and
the host tier: a load reads blocks into host slots (`HostBlockArrays`) in the background, a write
takes a block the runner copied off the device or the host tier. The prefix cache reaches it
through `tier_link.TierLink` only: lookups after a tree match, write-through and write-back
planned into the copy plan, background loads into host slots.

`DiskTier` (disk_tier.py: one file per block under a byte budget) implements it, and so does
`PoolTier` (pool_tier.py: one object per block in a store every engine of a cluster shares, on
Mooncake Store): `contains`/`num_leading` as existence checks, `plan_write`/`write` as puts of
missing blocks, `start_load`/`poll` as gets straight into the host slots.
`TierChain` (tier_chain.py) is one over both: the disk tier, then the pool tier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Upper bounds (seconds) of the buckets of KV load-time histograms (a tier's loads; a disaggregating
# router's pulls of KV from prefill workers); a last bucket holds the slower loads.
KV_LOAD_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclasses.dataclass
class KVTierStats:
    """Counters of a lower tier (guarded by the tier's own lock where threads update them)."""

    loads: int = 0  # load jobs finished
    loaded_blocks: int = 0  # blocks read, checked and put in host slots
    load_seconds: float = 0.0  # summed wall time of the load jobs
    # load jobs by wall time: count i took at most KV_LOAD_SECONDS_BUCKETS[i] (and more than the bound before)
    load_seconds_counts: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(KV_LOAD_SECONDS_BUCKETS) + 1))
    bytes_read: int = 0
    written_blocks: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0  # summed wall time of the file writes
    evictions: int = 0  # blocks deleted to stay within the budget
    damaged: int = 0  # blocks found damaged (at scan or read) and deleted
    missing: int = 0  # blocks indexed but gone when read (another engine evicted them)
    write_errors: int = 0
    outages: int = 0  # times the tier could not be reached and stopped being asked (the pool tier)


class HostBlockArrays:
    """The host tier's storage as numpy arrays with the host slot on axis 2 ([layers, heads, host slot, ...]);
    a block's payload is the bytes of `arrays[0][:, :, host slot]`, then `arrays[1][:, :, host slot]`, ...

    Each array's memory is laid out slot-major (`allocate`): a host slot's part of an array is one
    contiguous range, so a tier reads a block from a file or the pool straight into its slot
    (`slot_parts`), with no copy through a staging buffer."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        if not arrays or any(a.ndim < 3 for a in arrays):
            raise ValueError("host block arrays need a host slot axis (axis 2)")
        for a in arrays:
            slot = a[:, :, 0]
            if not slot.flags.c_contiguous or a.strides[2] != slot.nbytes:
                raise ValueError("host block arrays must be slot-major (HostBlockArrays.allocate)")
        self.arrays = list(arrays)
        self.payload_bytes = sum(a[:, :, 0].nbytes for a in self.arrays)

    @staticmethod
    def allocate(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A zeroed array of `shape` ([layers, heads, host slots, ...]) laid out slot-major, its pages
        touched now (np.full, not np.zeros' untouched pages): a first swap or tier load into it would
        otherwise pay the page faults, on the request it exists for."""
        order = (2, 0, 1, *range(3, len(shape)))
        memory = np.full(tuple(shape[i] for i in order), 0, dtype)
        return memory.transpose(np.argsort(order))

    def memory(self) -> list[tuple[int, int]]:
        """(address, bytes) of each array's memory (to register with a store)."""
        return [(a.ctypes.data, a.nbytes) for a in self.arrays]

    def slot_parts(self, host_slot: int) -> list[np.ndarray]:
        """A host slot's bytes in each array, in payload order (writable uint8 views)."""
        return [a[:, :, host_slot].reshape(-1).view(np.uint8) for a in self.arrays]

    @staticmethod
    def payload(arrays: Sequence[Any], i: int) -> list[memoryview]:
        """Block i (axis 2) of a copy's arrays (numpy, or anything `np.asarray` takes)."""
        return [memoryview(np.ascontiguousarray(np.asarray(a)[:, :, i])).cast("B") for a in arrays]


@dataclasses.dataclass(eq=False)
class LoadJob:
    """Blocks to read into host slots, in chain order; `loaded` leading ones succeeded."""

    keys: list[bytes]
    tokens: list[bytes]
    host_slots: list[int]
    nbytes: int
    loaded: int = 0
    done: bool = False
    cancelled: bool = False
    # (tier kind, blocks) runs in chain order where more than one tier reads the job's blocks
    # (`tier_chain.TierChain`); empty: the tier that started it reads them all
    sources: list[tuple[str, int]] = dataclasses.field(default_factory=list)


def load_seconds_bucket(seconds: float) -> int:
    """The bucket of KV_LOAD_SECONDS_BUCKETS (or the one above them) that a load of `seconds` counts in."""
    return sum(seconds > bound for bound in KV_LOAD_SECONDS_BUCKETS)


@runtime_checkable
class KVTier(Protocol):
    kind: str  # "disk" or "pool": the name its counters go by (`TierStats.lower_tiers`, /metrics)
    fingerprint: bytes  # the seed of the content keys it stores blocks under
    stats: KVTierStats

    @property
    def tiers(self) -> tuple[KVTier, ...]:
        """The single tiers it is made of, upper first: itself, or a `TierChain`'s tiers."""

    @property
    def num_blocks(self) -> int:
        """Blocks stored."""

    @property
    def num_bytes(self) -> int:
        """Bytes stored."""

    @property
    def capacity_blocks(self) -> int:
        """Most blocks it can store."""

    # lookups (the engine thread)

    def contains(self, key: bytes) -> bool:
        """Is the block stored?"""

    def num_leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are stored."""

    def touch(self, key: bytes) -> None:
        """Mark a stored block as just used (its eviction order)."""

    # writes: planned by the engine thread, bytes handed over by the runner

    def plan_write(self, key: bytes, tokens: bytes) -> int | None:
        """A ticket for storing block `key` whose token ids are `tokens` (None: stored already or
        being stored). The copy plan carries it to the runner, which passes it to `write`."""

    def write(self, tickets: Sequence[int], arrays: Sequence[Any]) -> None:
        """Store blocks in the background: block i (axis 2) of `arrays` is ticket i's."""

    def flush(self) -> None:
        """Wait until every queued write is stored."""

    # loads into host slots

    def can_load(self, num_blocks: int) -> bool:
        """Whether a load of `num_blocks` may start now (in-flight bound)."""

    def start_load(self, keys: list[bytes], tokens: list[bytes], host_slots: list[int]) -> LoadJob:
        """Read blocks into host slots in the background; `poll` returns the job once done."""

    def poll(self) -> list[LoadJob]:
        """Jobs finished since the last call (their host slots are the caller's again)."""

    def wait(self, timeout: float) -> bool:
        """Block until a load finishes or `timeout` seconds pass; True if one finished."""

    # lifetime

    @property
    def closed(self) -> bool: ...

    def close(self) -> None:
        """Finish queued writes and stop. Idempotent."""

    def check_integrity(self) -> None:
        """Raise AssertionError unless its own accounting is consistent."""
