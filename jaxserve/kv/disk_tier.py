"""The disk tier: KV blocks as files named by their content key, under a byte budget, LRU.

Layout: `<dir>/<fingerprint hex>/<first 2 hex of key>/<key hex>.kvb` (see `block_files`). The
directory is the index: at start the files' headers are scanned (damaged ones are deleted), so
blocks written before a restart, or by another engine on the same directory, are found again.
A key missing from the in-memory index is looked up on the disk too (one `stat`), which is how
an engine sees blocks another engine wrote after it started.

Two background threads do the I/O, so the engine thread never waits for the disk:
- the writer takes blocks the runner copied off the device or the host tier (`write`), and
  writes each as a file (temp + rename), evicting the least recently used files to stay within
  `capacity_bytes` (bytes on disk plus bytes being written never exceed it);
- the loader reads the files of a `LoadJob` into host slots, checking each file's header,
  length and checksum; the first block that is missing or damaged ends the job (a damaged file
  is deleted), and the caller recomputes from there. At most `max_inflight_bytes` are being
  read at once (one job larger than that may run alone).

Thread safety: every method may be called from the engine thread while the threads run; the
index and counters are guarded by one lock. A job's host slots belong to the loader until the job
is done (`poll`), also when it was cancelled.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.kv.block_files import (
    SUFFIX,
    TEMP_PREFIX,
    DamagedBlockFile,
    file_bytes,
    head_bytes,
    read_block,
    read_header,
    write_block,
)
from jaxserve.kv.kv_tier import HostBlockArrays, KVTier, KVTierStats, LoadJob, load_seconds_bucket

logger = logging.getLogger(__name__)

STALE_TEMP_SECONDS = 600.0  # a temporary file this old was left by a writer that died


class DiskTier:
    """A `KVTier` (kv_tier.py) of block files in one directory."""

    kind = "disk"

    def __init__(
        self,
        directory: str | os.PathLike,
        fingerprint: bytes,
        block_size: int,
        host: HostBlockArrays,
        capacity_bytes: int,
        max_inflight_bytes: int = 256 << 20,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the disk tier needs a positive byte budget, got {capacity_bytes}")
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.host = host
        self.payload_bytes = host.payload_bytes
        self.block_file_bytes = file_bytes(block_size, self.payload_bytes)
        self.capacity_bytes = capacity_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.root = Path(directory) / fingerprint.hex()
        self.root.mkdir(parents=True, exist_ok=True)
        self.stats = KVTierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, oldest first
        self._bytes = 0
        self._reserved = 0  # bytes of files being written
        self._writing: set[bytes] = set()
        self._tickets: dict[int, tuple[bytes, bytes]] = {}
        self._next_ticket = 0
        self._inflight = 0
        self._done: list[LoadJob] = []
        self._done_event = threading.Event()
        self._writes: queue.Queue = queue.Queue()
        self._loads: queue.Queue = queue.Queue()
        # the loader's buffer of a block's header and token ids (its payload goes straight to the host slot)
        self._read_head = np.full(head_bytes(block_size), 0, np.uint8)
        self._scan()
        self._threads = [
            threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True),
            threading.Thread(target=self._load_loop, name="kv-disk-loader", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ index

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    @property
    def num_blocks(self) -> int:
        """Block files indexed."""
        return len(self._index)

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.block_file_bytes

    @property
    def num_bytes(self) -> int:
        return self._bytes

    @property
    def tiers(self) -> tuple[KVTier, ...]:
        return (self,)

    def contains(self, key: bytes) -> bool:
        """Is the block on disk (as far as the index or one `stat` can tell)?"""
        with self._lock:
            if key in self._index:
                return True
        try:
            size = self.path(key).stat().st_size
        except OSError:
            return False
        if size != self.block_file_bytes:
            return False
        with self._lock:
            if key not in self._index and self._make_room(size):
                self._index[key] = size  # written by another engine: now ours to count
                self._bytes += size
            return key in self._index

    def num_leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are on disk."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def touch(self, key: bytes) -> None:
        """Mark a block on disk as just used (LRU order, and its file's time for the next scan)."""
        with self._lock:
            if key not in self._index:
                return
            self._index.move_to_end(key)
        try:
            os.utime(self.path(key))
        except OSError:
            pass

    def _make_room(self, size: int) -> bool:
        """Delete least recently used files until `size` more bytes fit (lock held)."""
        if size > self.capacity_bytes:
            return False
        while self._bytes + self._reserved + size > self.capacity_bytes and self._index:
            key, old = self._index.popitem(last=False)
            self._bytes -= old
            self.stats.evictions += 1
            self.path(key).unlink(missing_ok=True)
        return self._bytes + self._reserved + size <= self.capacity_bytes

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def _scan(self) -> None:
        """Rebuild the index from the files' headers, oldest first; delete damaged files."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for sub in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for path in sub.iterdir():
                try:
                    stat = path.stat()
                    if path.name.startswith(TEMP_PREFIX):
                        if now - stat.st_mtime > STALE_TEMP_SECONDS:
                            path.unlink(missing_ok=True)
                        continue
                    if path.suffix != SUFFIX:
                        continue
                    fp, key, num_tokens, payload = read_header(path)
                    if (
                        fp != self.fingerprint
                        or key.hex() + SUFFIX != path.name
                        or sub.name != path.name[:2]
                        or num_tokens != self.block_size
                        or payload != self.payload_bytes
                    ):
                        raise DamagedBlockFile("header does not match its name or this model")
                except DamagedBlockFile as e:
                    logger.warning("deleting KV block file %s: %s", path, e)
                    self.stats.damaged += 1
                    path.unlink(missing_ok=True)
                    continue
                except OSError:
                    continue  # gone meanwhile (another engine evicted it)
                found.append((stat.st_mtime, key, stat.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._bytes += size
            self._make_room(0)

    # ------------------------------------------------------------------ writes

    def plan_write(self, key: bytes, tokens: bytes) -> int | None:
        """A ticket for writing block `key` (None: on disk already or being written). The runner
        passes it back with the block's bytes to `write`."""
        with self._lock:
            if key in self._index or key in self._writing:
                return None
            self._writing.add(key)
            ticket = self._next_ticket
            self._next_ticket += 1
            self._tickets[ticket] = (key, tokens)
            return ticket

    def write(self, tickets: Sequence[int], arrays: Sequence[Any]) -> None:
        """Queue blocks for writing: block i (axis 2) of `arrays` is ticket i's. `arrays` may be
        device arrays whose copy to the host is still running; the writer thread waits for it."""
        with self._lock:
            jobs = [self._tickets.pop(t) for t in tickets]
        self._writes.put((jobs, list(arrays)))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                self._writes.task_done()
                return
            jobs, arrays = item
            try:
                arrays = [np.asarray(a) for a in arrays]
                for i, (key, tokens) in enumerate(jobs):
                    self._write_one(key, tokens, HostBlockArrays.payload(arrays, i))
            except Exception:  # noqa: BLE001 - a failed write costs a recompute, never the engine
                logger.exception("writing KV blocks to disk failed")
                with self._lock:
                    self.stats.write_errors += 1
                    self._writing.difference_update(key for key, _ in jobs)
            self._writes.task_done()

    def _write_one(self, key: bytes, tokens: bytes, payload: list[memoryview]) -> None:
        size = self.block_file_bytes
        with self._lock:
            ok = key not in self._index and self._make_room(size)
            if ok:
                self._reserved += size
            else:
                self._writing.discard(key)
        if not ok:
            return
        path = self.path(key)
        written = 0
        t0 = time.perf_counter()
        try:
            path.parent.mkdir(exist_ok=True)
            written = write_block(path, self.fingerprint, key, tokens, payload)
        except OSError as e:
            logger.warning("could not write KV block file %s: %s", path, e)
            with self._lock:
                self.stats.write_errors += 1
        with self._lock:
            self._reserved -= size
            self._writing.discard(key)
            if written:
                if key not in self._index:
                    self._index[key] = size
                    self._bytes += size
                self.stats.written_blocks += 1
                self.stats.bytes_written += written
                self.stats.write_seconds += time.perf_counter() - t0

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._writes.join()

    # ------------------------------------------------------------------ loads

    def can_load(self, num_blocks: int) -> bool:
        nbytes = num_blocks * self.block_file_bytes
        return self._inflight == 0 or self._inflight + nbytes <= self.max_inflight_bytes

    def start_load(self, keys: list[bytes], tokens: list[bytes], host_slots: list[int]) -> LoadJob:
        """Read blocks into host slots in the background; `poll` returns the job once done."""
        if not len(keys) == len(tokens) == len(host_slots) or not keys:
            raise ValueError("a load needs as many keys, token blocks and host slots, at least one")
        job = LoadJob(keys, tokens, host_slots, len(keys) * self.block_file_bytes)
        with self._lock:
            self._inflight += job.nbytes
        self._loads.put(job)
        return job

    def _load_loop(self) -> None:
        while True:
            job = self._loads.get()
            if job is None:
                return
            t0 = time.perf_counter()
            for key, tokens, host_slot in zip(job.keys, job.tokens, job.host_slots):
                if job.cancelled:
                    break
                path = self.path(key)
                try:
                    parts = self.host.slot_parts(host_slot)
                    read_block(path, self.fingerprint, key, tokens, self._read_head, parts)
                except FileNotFoundError:
                    self._forget(key)
                    with self._lock:
                        self.stats.missing += 1
                    break
                except (DamagedBlockFile, OSError) as e:
                    logger.warning("KV block file %s is unusable (%s); deleting it, the block is recomputed", path, e)
                    self._forget(key)
                    path.unlink(missing_ok=True)
                    with self._lock:
                        self.stats.damaged += 1
                    break
                job.loaded += 1
                with self._lock:
                    if key in self._index:
                        self._index.move_to_end(key)
                    self.stats.bytes_read += self.block_file_bytes
                try:
                    os.utime(path)  # the LRU order survives a restart (the scan sorts by time)
                except OSError:
                    pass
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

    def poll(self) -> list[LoadJob]:
        """Jobs finished since the last call (their host slots are the caller's again)."""
        with self._lock:
            done, self._done = self._done, []
            self._done_event.clear()
        return done

    def wait(self, timeout: float) -> bool:
        """Block until a load finishes or `timeout` seconds pass; True if one finished."""
        return self._done_event.wait(timeout)

    # ------------------------------------------------------------------ lifetime and checks

    @property
    def closed(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Finish queued writes and stop the threads (loads in flight finish first). Idempotent."""
        if self.closed:
            return
        self._writes.put(None)
        self._loads.put(None)
        for t in self._threads:
            t.join(60)

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(self._index.values())
            if total != self._bytes:
                raise AssertionError(f"disk index counts {self._bytes} bytes, its files {total}")
            if self._bytes + self._reserved > self.capacity_bytes:
                raise AssertionError(f"disk tier over budget: {self._bytes} + {self._reserved} > {self.capacity_bytes}")
            if self._reserved < 0 or self._inflight < 0:
                raise AssertionError("negative reserved or in-flight bytes")
