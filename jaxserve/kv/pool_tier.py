"""The pool tier: KV blocks in a store that every engine of a cluster shares (a `BlockStore`:
Mooncake Store, `jaxserve/mooncake_store.py`), so a prefix one worker computed is read by the others.

One object per block, named by the fingerprint of the model and cache layout and the block's
content key (`jaxserve/<fingerprint hex>/<key hex>`: the keys the prefix cache, the disk tier and
the router use), holding the bytes a disk-tier file holds (header, token ids, K and V:
`block_files`). A block read back is checked against everything expected of it (model, key,
tokens, length, checksum), so a foreign or damaged object is never used.

A writer and a loader thread move the bytes, through memory registered with the store, so the
engine thread never waits:
- a write copies its blocks into a staging array (`staging_blocks` objects) and puts them in one
  batch, after one existence check so that only blocks missing from the pool move;
- a load gets its blocks in batches straight into their host slots (the host tier's arrays are
  registered; each object's header and token ids go to a small array of their own), and a checker
  thread checks each batch there while the next one is got; the first block missing (the pool
  evicts by its own policy) or damaged ends the job, and the request recomputes from there (a
  damaged block's slot, and those got after it, are never used).

Faults. When the store cannot be reached (its master died), the tier marks itself down: lookups
answer "not stored", writes are dropped, loads are not started, and a probe thread asks the store
every `probe_seconds` until it answers again (a restarted master has lost every object: the tier
starts over empty). Requests never fail because of the pool; they recompute.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from jaxserve.kv.block_files import HEADER_BYTES, DamagedBlockFile, block_header, check_block, file_bytes
from jaxserve.kv.block_store import MISSING, UNAVAILABLE, BlockStore
from jaxserve.kv.kv_tier import HostBlockArrays, KVTier, KVTierStats, LoadJob, load_seconds_bucket
from jaxserve.kv.pool_health import KnownKeys, PoolHealth

logger = logging.getLogger(__name__)

_WHOLE: Future[bool] = Future()  # a check that found its batch whole (before a job's first batch)
_WHOLE.set_result(True)


class PoolTier:
    """A `KVTier` (kv_tier.py) on a shared `BlockStore`."""

    kind = "pool"

    def __init__(
        self,
        store: BlockStore,
        fingerprint: bytes,
        block_size: int,
        host: HostBlockArrays,
        capacity_bytes: int,
        *,
        staging_blocks: int = 64,
        max_inflight_bytes: int = 256 << 20,
        probe_seconds: float = 1.0,
    ) -> None:
        if capacity_bytes <= 0 or staging_blocks <= 0:
            raise ValueError("the pool tier needs a positive capacity and staging size")
        self.store = store
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.host = host
        self.payload_bytes = host.payload_bytes
        self.object_bytes = file_bytes(block_size, self.payload_bytes)
        self.capacity_bytes = capacity_bytes
        self.staging_blocks = staging_blocks
        self.max_inflight_bytes = max_inflight_bytes
        self.probe_seconds = probe_seconds
        self.stats = KVTierStats()
        self._prefix = f"jaxserve/{fingerprint.hex()}/"
        # Touched now (np.full): the first transfers would otherwise pay the page faults.
        self._write_staging = np.full(staging_blocks * self.object_bytes, 0, np.uint8)
        # two halves: a batch's heads are checked while the next batch's are got
        self._load_heads = np.full(2 * staging_blocks * (self.object_bytes - self.payload_bytes), 0, np.uint8)
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="kv-pool-checker")
        for array in (self._write_staging, self._load_heads):
            store.register(array.ctypes.data, array.nbytes)
        for address, nbytes in host.memory():  # loads land in the host slots themselves
            store.register(address, nbytes)
        self._lock = threading.Lock()
        self._known = KnownKeys()
        # a restarted master has lost every object: forget what was known when it answers again
        self.health = PoolHealth(store, self._prefix + "probe", probe_seconds, self.stats, self._known.clear)
        self._writing: set[bytes] = set()
        self._tickets: dict[int, tuple[bytes, bytes]] = {}
        self._next_ticket = 0
        self._inflight = 0
        self._done: list[LoadJob] = []
        self._done_event = threading.Event()
        self._writes: queue.Queue = queue.Queue()
        self._loads: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._write_loop, name="kv-pool-writer", daemon=True),
            threading.Thread(target=self._load_loop, name="kv-pool-loader", daemon=True),
            threading.Thread(target=self.health.probe_loop, name="kv-pool-probe", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def name(self, key: bytes) -> str:
        """The pool object of block `key`."""
        return self._prefix + key.hex()

    # ------------------------------------------------------------------ state

    @property
    def is_up(self) -> bool:
        return not self.health.down.is_set()

    @property
    def num_blocks(self) -> int:
        """Blocks this engine knows the pool holds (written or found by it)."""
        return len(self._known)

    @property
    def num_bytes(self) -> int:
        return len(self._known) * self.object_bytes

    @property
    def capacity_blocks(self) -> int:
        """Blocks that fit in the memory this engine lends the pool."""
        return self.capacity_bytes // self.object_bytes

    @property
    def tiers(self) -> tuple[KVTier, ...]:
        return (self,)

    # ------------------------------------------------------------------ lookups (engine thread)

    def contains(self, key: bytes) -> bool:
        return self.num_leading([key]) == 1

    def num_leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the pool holds (one round trip)."""
        if not keys or not self.is_up:
            return 0
        results = self.store.exists([self.name(k) for k in keys])
        self.health.check(results)
        n = 0
        while n < len(keys) and results[n] == 1:
            n += 1
        self._known.add(keys[:n])
        return n

    def touch(self, key: bytes) -> None:
        self._known.touch(key)

    # ------------------------------------------------------------------ writes

    def plan_write(self, key: bytes, tokens: bytes) -> int | None:
        with self._lock:
            if not self.is_up or key in self._known or key in self._writing:
                return None
            self._writing.add(key)
            ticket = self._next_ticket
            self._next_ticket += 1
            self._tickets[ticket] = (key, tokens)
            return ticket

    def write(self, tickets: Sequence[int], arrays: Sequence[Any]) -> None:
        """Queue blocks for the pool: block i (axis 2) of `arrays` is ticket i's (device arrays
        whose copy to the host may still run: the writer waits for it)."""
        with self._lock:
            jobs = [self._tickets.pop(t) for t in tickets]
        self._writes.put((jobs, list(arrays)))

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            jobs, arrays = item
            try:
                arrays = [np.asarray(a) for a in arrays]
                for first in range(0, len(jobs), self.staging_blocks):
                    self._write_batch(jobs, arrays, first)
            except Exception:  # noqa: BLE001 - a failed write costs a recompute, never the engine
                logger.exception("writing KV blocks to the pool failed")
                with self._lock:
                    self.stats.write_errors += 1
            with self._lock:
                self._writing.difference_update(key for key, _ in jobs)
            self._writes.task_done()
        self._writes.task_done()

    def _write_batch(self, jobs: list[tuple[bytes, bytes]], arrays: list[np.ndarray], first: int) -> None:
        """Put jobs[first : first + staging_blocks] that the pool lacks."""
        batch = range(first, min(first + self.staging_blocks, len(jobs)))
        if not self.is_up:
            return
        stored = self.store.exists([self.name(jobs[i][0]) for i in batch])
        self.health.check(stored)
        self._known.add([jobs[i][0] for i, s in zip(batch, stored) if s == 1])
        missing = [i for i, s in zip(batch, stored) if s == 0]
        if not missing:
            return
        t0 = time.perf_counter()
        size = self.object_bytes
        addresses = [
            stage_block(
                self._write_staging[j * size : (j + 1) * size], self.fingerprint, *jobs[i], [a[:, :, i] for a in arrays]
            )
            for j, i in enumerate(missing)
        ]
        keys = [jobs[i][0] for i in missing]
        results = self.store.put([self.name(k) for k in keys], addresses, [self.object_bytes] * len(keys))
        self.health.check(results)
        written = [k for k, r in zip(keys, results) if r == 0]
        self._known.add(written)
        with self._lock:
            self.stats.written_blocks += len(written)
            self.stats.bytes_written += len(written) * self.object_bytes
            self.stats.write_errors += sum(r not in (0, UNAVAILABLE) for r in results)
            self.stats.write_seconds += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self._writes.join()

    # ------------------------------------------------------------------ loads

    def can_load(self, num_blocks: int) -> bool:
        nbytes = num_blocks * self.object_bytes
        return self.is_up and (self._inflight == 0 or self._inflight + nbytes <= self.max_inflight_bytes)

    def start_load(self, keys: list[bytes], tokens: list[bytes], host_slots: list[int]) -> LoadJob:
        if not len(keys) == len(tokens) == len(host_slots) or not keys:
            raise ValueError("a load needs as many keys, token blocks and host slots, at least one")
        job = LoadJob(keys, tokens, host_slots, len(keys) * self.object_bytes)
        with self._lock:
            self._inflight += job.nbytes
        self._loads.put(job)
        return job

    def _load_loop(self) -> None:
        """Each job's blocks in batches of `staging_blocks`, each batch checked on the checker thread
        while the next is got; a job stops at its first block missing or damaged."""
        while (job := self._loads.get()) is not None:
            t0 = time.perf_counter()
            checked: Future[bool] = _WHOLE
            try:
                for n, first in enumerate(range(0, len(job.keys), self.staging_blocks)):
                    if job.cancelled:
                        break
                    got = self._get_batch(job, first, n % 2)
                    if not checked.result():  # the batch before it was not whole: this one is not used
                        break
                    checked = self._checker.submit(self._check_batch, job, *got)
                checked.result()  # the last check (raises what it raised)
            except Exception:  # noqa: BLE001 - a failed load costs a recompute, never the engine
                wait([checked])  # no check outlives its job
                logger.exception("reading KV blocks from the pool failed")
                if job.loaded < len(job.keys):  # not offered again: recomputed from there
                    self._known.discard(job.keys[job.loaded])
            with self._lock:
                self._inflight -= job.nbytes
                self.stats.loads += 1
                self.stats.loaded_blocks += job.loaded
                seconds = time.perf_counter() - t0
                self.stats.load_seconds += seconds
                self.stats.load_seconds_counts[load_seconds_bucket(seconds)] += 1
                job.done = True
                self._done.append(job)
            self._done_event.set()

    def _get_batch(self, job: LoadJob, first: int, area: int) -> tuple[range, list, list, list[int]]:
        """Get job.keys[first : first + staging_blocks] straight into their host slots, each object's
        header and token ids into half `area` of the load heads' array; (batch, heads, parts, results)."""
        batch = range(first, min(first + self.staging_blocks, len(job.keys)))
        head = self.object_bytes - self.payload_bytes
        start = area * self.staging_blocks
        heads = [self._load_heads[(start + j) * head : (start + j + 1) * head] for j in range(len(batch))]
        parts = [self.host.slot_parts(job.host_slots[i]) for i in batch]
        buffers = [[a.ctypes.data for a in (h, *p)] for h, p in zip(heads, parts)]
        sizes = [[head] + [part.nbytes for part in p] for p in parts]
        results = self.store.get([self.name(job.keys[i]) for i in batch], buffers, sizes)
        self.health.check(results)
        return batch, heads, parts, results

    def _check_batch(self, job: LoadJob, batch: range, heads: list, parts: list, results: list[int]) -> bool:
        """Count a got batch's blocks loaded, in order, while whole and unchanged; False at the first not."""
        for j, (i, result) in enumerate(zip(batch, results)):
            key = job.keys[i]
            if result != self.object_bytes:
                self._known.discard(key)
                with self._lock:
                    self.stats.missing += result == MISSING
                return False
            try:
                check_block(heads[j], parts[j], self.fingerprint, key, job.tokens[i], self.payload_bytes)
            except DamagedBlockFile as e:
                logger.warning("KV pool object %s is unusable (%s); the block is recomputed", self.name(key), e)
                self._known.discard(key)
                with self._lock:
                    self.stats.damaged += 1
                return False
            job.loaded += 1
            with self._lock:
                self.stats.bytes_read += self.object_bytes
        self._known.add([job.keys[i] for i in batch])
        return True

    def poll(self) -> list[LoadJob]:
        with self._lock:
            done, self._done = self._done, []
            self._done_event.clear()
        return done

    def wait(self, timeout: float) -> bool:
        return self._done_event.wait(timeout)

    # ------------------------------------------------------------------ faults and lifetime

    @property
    def closed(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Finish queued writes, stop the threads and leave the pool. Idempotent."""
        if self.closed:
            return
        self._writes.put(None)
        self._loads.put(None)
        self.health.stop.set()
        for t in self._threads:
            t.join(60)
        self._checker.shutdown()
        self.store.close()

    def check_integrity(self) -> None:
        with self._lock:
            if self._inflight < 0:
                raise AssertionError("negative in-flight bytes")
            if len(self._known) > self._known.limit:
                raise AssertionError(f"{len(self._known)} keys remembered, the bound is {self._known.limit}")


def stage_block(obj: np.ndarray, fingerprint: bytes, key: bytes, tokens: bytes, parts: list[np.ndarray]) -> int:
    """Lay out one pool object in `obj` (a slice of a registered array): header, token ids, then
    `parts` (the block's K and V); returns its address."""
    at = HEADER_BYTES + len(tokens)
    obj[HEADER_BYTES:at] = np.frombuffer(tokens, np.uint8)
    for part in parts:
        n = part.nbytes
        obj[at : at + n] = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
        at += n
    payload = memoryview(obj[HEADER_BYTES + len(tokens) :])
    obj[:HEADER_BYTES] = np.frombuffer(block_header(fingerprint, key, tokens, [payload]), np.uint8)
    return obj.ctypes.data
