"""Two tiers below the host tier as one `KVTier`: the upper one first (the disk tier: this engine's
blocks, kept across restarts), then the lower one (the pool tier: blocks every engine of a cluster
shares). The prefix cache's link (`tier_link.TierLink`) sees one tier.

- Lookups: a block is stored when either tier holds it; a run of keys is asked of the upper tier
  first and of the lower one for what the upper lacks (one round trip per change of tier).
- Loads: each block is read from the upper tier when it holds it, else from the lower; one job per
  run of blocks of one tier, all running at once. The chain's job is done when all of its runs are;
  its `loaded` blocks are the leading ones that every run before them read whole, and its `sources`
  say which tier read which of them (`TierLink` counts hit tokens per tier from them).
- Writes go through to both: a block is planned for each tier that lacks it (none: no ticket).
- Flush, close and checks reach both. A lower tier that cannot be reached (the pool's master died)
  answers "not stored" and drops writes; the upper tier goes on serving its blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.kv.kv_tier import KVTier, KVTierStats, LoadJob


class _Blocks:
    """Blocks `index` (axis 2) of an array, taken when the tier's writer thread converts it (a device
    array may still be copying to the host: the runner's thread does not wait for it)."""

    def __init__(self, array: Any, index: list[int]) -> None:
        self.array = array
        self.index = index

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        blocks = np.asarray(self.array)[:, :, self.index]
        return blocks if dtype is None else blocks.astype(dtype)


@dataclasses.dataclass(eq=False)
class _ChainLoad:
    job: LoadJob  # the chain's job, handed to the caller
    runs: list[LoadJob]  # the tiers' jobs, in chain order
    done: set[LoadJob] = dataclasses.field(default_factory=set)


class TierChain:
    """A `KVTier` (kv_tier.py) over an upper and a lower tier (see the module docstring)."""

    def __init__(self, upper: KVTier, lower: KVTier) -> None:
        if upper.fingerprint != lower.fingerprint:
            raise ValueError("the tiers of a chain must store blocks under the same fingerprint")
        self.upper = upper
        self.lower = lower
        self.kind = f"{upper.kind}+{lower.kind}"
        self.fingerprint = upper.fingerprint
        self._lock = threading.Lock()
        self._tickets: dict[int, tuple[int | None, int | None]] = {}
        self._next_ticket = itertools.count()
        self._loads: dict[LoadJob, _ChainLoad] = {}  # by each tier's job

    @property
    def tiers(self) -> tuple[KVTier, ...]:
        return (*self.upper.tiers, *self.lower.tiers)

    @property
    def stats(self) -> KVTierStats:
        """The sum of the tiers' counters (each tier's own stay under its own name: `tiers`)."""
        a, b = self.upper.stats, self.lower.stats
        summed: dict[str, Any] = {}
        for f in dataclasses.fields(KVTierStats):
            x, y = getattr(a, f.name), getattr(b, f.name)
            summed[f.name] = [p + q for p, q in zip(x, y)] if isinstance(x, list) else x + y
        return KVTierStats(**summed)

    @property
    def num_blocks(self) -> int:
        """Blocks stored, counted in each tier that holds them."""
        return self.upper.num_blocks + self.lower.num_blocks

    @property
    def num_bytes(self) -> int:
        return self.upper.num_bytes + self.lower.num_bytes

    @property
    def capacity_blocks(self) -> int:
        """The most blocks one of its tiers can store."""
        return max(self.upper.capacity_blocks, self.lower.capacity_blocks)

    # ------------------------------------------------------------------ lookups

    def contains(self, key: bytes) -> bool:
        return self.upper.contains(key) or self.lower.contains(key)

    def num_leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, one tier or the other holds."""
        n = 0
        while n < len(keys):
            upper = self.upper.num_leading(keys[n:])
            n += upper
            if n == len(keys):
                break
            lower = self.lower.num_leading(keys[n:])
            n += lower
            if lower == 0:
                break
        return n

    def touch(self, key: bytes) -> None:
        self.upper.touch(key)
        self.lower.touch(key)

    # ------------------------------------------------------------------ writes

    def plan_write(self, key: bytes, tokens: bytes) -> int | None:
        """A ticket for writing the block to each tier that lacks it (None: both hold it or write it)."""
        tickets = (self.upper.plan_write(key, tokens), self.lower.plan_write(key, tokens))
        if tickets == (None, None):
            return None
        with self._lock:
            ticket = next(self._next_ticket)
            self._tickets[ticket] = tickets
        return ticket

    def write(self, tickets: Sequence[int], arrays: Sequence[Any]) -> None:
        """Hand each tier the blocks planned for it: block i (axis 2) of `arrays` is ticket i's."""
        with self._lock:
            planned = [self._tickets.pop(t) for t in tickets]
        for tier, column in ((self.upper, 0), (self.lower, 1)):
            chosen = [i for i, pair in enumerate(planned) if pair[column] is not None]
            if not chosen:
                continue
            own = [planned[i][column] for i in chosen]
            if chosen == list(range(len(chosen))):  # the leading blocks: the arrays as they are
                tier.write(own, list(arrays))
            else:
                tier.write(own, [_Blocks(a, chosen) for a in arrays])

    def flush(self) -> None:
        self.upper.flush()
        self.lower.flush()

    # ------------------------------------------------------------------ loads

    def can_load(self, num_blocks: int) -> bool:
        """Whether one of the tiers may start a load now (a lower tier that is down never may)."""
        return self.upper.can_load(num_blocks) or self.lower.can_load(num_blocks)

    def start_load(self, keys: list[bytes], tokens: list[bytes], host_slots: list[int]) -> LoadJob:
        """Read each block from the upper tier if it holds it, else from the lower, in the background."""
        if not len(keys) == len(tokens) == len(host_slots) or not keys:
            raise ValueError("a load needs as many keys, token blocks and host slots, at least one")
        runs: list[LoadJob] = []
        sources: list[tuple[str, int]] = []
        first = 0
        for upper, group in itertools.groupby(range(len(keys)), key=lambda i: self.upper.contains(keys[i])):
            n = len(list(group))
            tier = self.upper if upper else self.lower
            part = slice(first, first + n)
            runs.append(tier.start_load(keys[part], tokens[part], host_slots[part]))
            sources.append((tier.kind, n))
            first += n
        job = LoadJob(keys, tokens, host_slots, sum(r.nbytes for r in runs), sources=sources)
        load = _ChainLoad(job, runs)
        with self._lock:
            for run in runs:
                self._loads[run] = load
        return job

    def poll(self) -> list[LoadJob]:
        """The chain's jobs whose runs are all done since the last call."""
        finished = []
        with self._lock:
            for load in {id(v): v for v in self._loads.values()}.values():
                if load.job.cancelled:  # the caller gave up: the tiers stop reading
                    for run in load.runs:
                        run.cancelled = True
            for run in self.upper.poll() + self.lower.poll():
                load = self._loads.pop(run)
                load.done.add(run)
                if len(load.done) == len(load.runs):
                    load.job.loaded = _leading_loaded(load.runs)
                    load.job.done = True
                    finished.append(load.job)
        return finished

    def wait(self, timeout: float) -> bool:
        """Block until a run of a load finishes or `timeout` seconds pass; True if one finished."""
        deadline = time.monotonic() + timeout
        while not (self.upper.wait(0) or self.lower.wait(min(timeout, 0.005))):
            if time.monotonic() >= deadline:
                return False
        return True

    # ------------------------------------------------------------------ lifetime

    @property
    def closed(self) -> bool:
        return self.upper.closed and self.lower.closed

    def close(self) -> None:
        """Finish both tiers' queued writes and stop them. Idempotent."""
        self.upper.close()
        self.lower.close()

    def check_integrity(self) -> None:
        self.upper.check_integrity()
        self.lower.check_integrity()
        with self._lock:
            for run, load in self._loads.items():
                if run not in load.runs or run in load.done:
                    raise AssertionError("a chain load's run is tracked twice or under another load")


def _leading_loaded(runs: list[LoadJob]) -> int:
    """Blocks read whole from the start: every run's, up to and including the first one cut short."""
    loaded = 0
    for run in runs:
        loaded += run.loaded
        if run.loaded < len(run.keys):
            break
    return loaded
