"""The radix cache's link to the disk tier: content keys, writes to disk, and background loads.

Writes. Every write is planned into the copy plan (`DEVICE_TO_DISK` / `HOST_TO_DISK`, with a
ticket of the disk tier as destination), so the runner reads the block exactly when its turn in
the plan comes: after the copies that filled it, before any later one that reuses its space.
- write-through: with `write_through_hits == 0` every block is written when it enters the prefix
  cache; with N > 0 once it has been part of N admitted hits (HiCache's selective
  write-through: only what is reused pays for the disk);
- write-back: a cached block leaving the device without a host slot, or leaving the host tier,
  is written if the disk does not hold it yet.

Loads. A prompt whose tree match ends where the disk continues it (its next blocks' keys are on
disk) can start a load: host slots are reserved, the match node is locked, and once the copies
planned so far have run (`submit`: a slot freed this round may still be read by one of them, a
host -> device copy or a write-back) the disk tier's loader thread reads the files into the slots. When the job is done (`poll`), the blocks that
read back whole join the tree as an idle host node locked for the request, and the request's
next match finds them on the host tier; admission copies them to the device as any host hit.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.kv.content_keys import ChainKeys, chain_keys, next_key
from jaxserve.kv.copy_plan import CopyKind, CopyPlan
from jaxserve.kv.disk_tier import DiskTier, LoadJob
from jaxserve.kv.radix_cache import RadixCache
from jaxserve.kv.radix_node import RadixNode, token_bytes

MAX_HIT_COUNTS = 1 << 20  # distinct keys counted for selective write-through before a reset


class LoadStart(enum.Enum):
    STARTED = "started"  # the request waits for its blocks
    BUSY = "busy"  # loads in flight use the byte bound: try again next step
    NONE = "none"  # nothing to load (or no host room): recompute instead


@dataclass(eq=False)
class _Load:
    job: LoadJob | None  # None until submitted
    node: RadixNode  # locked for the request: the match node, then the loaded node
    tokens: bytes  # the loaded blocks' token ids (int32 bytes)
    slots: list[int]  # host slots the load holds until it is done
    done: bool = False
    cancelled: bool = False
    loaded: tuple[int, int] = (0, 0)  # token positions the load added to the tree
    # Where an earlier load of the same request began adding (a prefix loaded in parts, when the
    # host tier had room for only some of it): the disk hits counted at admission start there.
    loaded_from: int | None = None


class DiskLink:
    def __init__(self, disk: DiskTier, cache: RadixCache, copies: CopyPlan, *, write_through_hits: int = 0) -> None:
        if cache.host is None or cache.host.num_slots == 0:
            raise ValueError("the disk tier loads through the host tier: give it host slots")
        if write_through_hits < 0:
            raise ValueError(f"write_through_hits must be >= 0, got {write_through_hits}")
        self.disk = disk
        self.cache = cache
        self.copies = copies
        self.block_size = cache.block_size
        self.write_through_hits = write_through_hits
        self.disk_hit_tokens = 0  # prompt tokens admitted from blocks the disk tier loaded
        self._loads: dict[Hashable, _Load] = {}
        self._by_job: dict[LoadJob, Hashable] = {}
        self._unsubmitted: list[tuple[list[bytes], list[bytes], list[int], Hashable]] = []
        self._hits: dict[bytes, int] = {}
        cache.on_drop = self._write_back

    def new_chain(self) -> ChainKeys:
        return ChainKeys(self.disk.fingerprint, self.block_size)

    # ------------------------------------------------------------------ lookups

    def blocks_on_disk(self, tokens: Sequence[int] | np.ndarray, chain: ChainKeys, first: int, limit: int) -> int:
        """How many blocks from block `first` (below `limit`) continue on the disk."""
        if first >= limit:
            return 0
        if not self.disk.contains(chain.keys(tokens, first + 1)[first]):
            return 0
        return 1 + self.disk.num_leading(chain.keys(tokens, limit)[first + 1 :])

    # ------------------------------------------------------------------ writes

    def _plan(self, kind: CopyKind, src: int, key: bytes, tokens: bytes) -> bool:
        """Plan writing one block; False when it is on disk already or being written."""
        ticket = self.disk.plan_write(key, tokens)
        if ticket is not None:
            self.copies.add(kind, src, ticket)
        return ticket is not None

    def write_through(self, chain: ChainKeys, tokens: Sequence[int] | np.ndarray, blocks: dict[int, int]) -> None:
        """A request's blocks just entered the cache: `blocks` maps block index -> device block."""
        if self.write_through_hits or not blocks:
            return
        bs = self.block_size
        keys = chain.keys(tokens, max(blocks) + 1)
        for i, block in blocks.items():
            self._plan(CopyKind.DEVICE_TO_DISK, block, keys[i], token_bytes(tokens[i * bs : (i + 1) * bs], bs))

    def count_hits(self, chain: ChainKeys, tokens: Sequence[int] | np.ndarray, device_blocks: Sequence[int]) -> None:
        """An admission reused `device_blocks` (the first blocks of `tokens`): selective write-through."""
        n = self.write_through_hits
        if not n or not device_blocks:
            return
        if len(self._hits) > MAX_HIT_COUNTS:
            self._hits.clear()
        bs = self.block_size
        for i, (key, block) in enumerate(zip(chain.keys(tokens, len(device_blocks)), device_blocks)):
            count = self._hits.get(key, 0) + 1
            if count >= n:
                self._hits.pop(key, None)
                self._plan(CopyKind.DEVICE_TO_DISK, block, key, token_bytes(tokens[i * bs : (i + 1) * bs], bs))
            else:
                self._hits[key] = count

    def _write_back(self, node: RadixNode, take: int) -> None:
        """The cache drops the last `take` blocks of `node`: write those the disk lacks."""
        path = self.cache.node_tokens(node)
        bs = self.block_size
        keys = chain_keys(self.disk.fingerprint, path, node.end, bs)
        on_device = node.blocks is not None
        storage = node.blocks if on_device else node.host_slots
        kind = CopyKind.DEVICE_TO_DISK if on_device else CopyKind.HOST_TO_DISK
        for j in range(node.length - take, node.length):
            i = node.start + j
            self._plan(kind, storage[j], keys[i], path[i * bs : (i + 1) * bs].tobytes())

    def flush(self) -> int:
        """At a clean shutdown: plan writes of the cached blocks (device and host tier) the disk
        lacks, so the next engine on the directory finds them. Most recently used first, and no
        more blocks than the disk budget holds, counting the cached blocks already on disk (those
        are touched, so the new files evict older ones, never them). Written oldest first, so the
        disk's LRU order (and the file times the next start sorts by) follows the cache's.
        Returns the blocks planned for writing."""
        disk, kb = self.disk, self.block_size * 4
        room = disk.capacity_bytes // disk.block_file_bytes
        keys: dict[RadixNode, bytes] = {self.cache.root: disk.fingerprint}  # last key of each node's path
        chosen: list[tuple[RadixNode, int, bytes]] = []
        for node in self.cache.nodes_by_recency():
            if len(chosen) == room:
                break
            key = keys[node.parent]
            for j in range(min(node.length, room - len(chosen))):
                key = next_key(key, node.key[j * kb : (j + 1) * kb])
                chosen.append((node, j, key))
            keys[node] = key
        planned = 0
        for node, j, key in reversed(chosen):
            if disk.contains(key):
                disk.touch(key)
                continue
            if node.on_device:
                kind, src = CopyKind.DEVICE_TO_DISK, node.blocks[j]
            else:
                kind, src = CopyKind.HOST_TO_DISK, node.host_slots[j]
            planned += self._plan(kind, src, key, node.key[j * kb : (j + 1) * kb])
        return planned

    # ------------------------------------------------------------------ loads

    def start_load(
        self, req_id: Hashable, node: RadixNode, tokens: Sequence[int] | np.ndarray, chain: ChainKeys, num_blocks: int
    ) -> LoadStart:
        """Load the `num_blocks` blocks after `node` (the request's tree match) from disk.

        A request whose earlier load is done but that was not admitted yet (its match still
        continues on disk: the host tier had room for only part of it) loads the rest; its
        earlier load's lock is handed over once the new one has started."""
        earlier = self._loads.get(req_id)
        if earlier is not None and not earlier.done:
            raise ValueError(f"request {req_id!r} is loading already")
        disk, cache = self.disk, self.cache
        cache.lock(node)  # before reserving slots: reserving may evict idle host blocks
        room = cache.host.num_free + cache.num_evictable_host_blocks
        n = min(num_blocks, room)
        if n <= 0:
            cache.unlock(node)
            return LoadStart.NONE
        if not disk.can_load(n * disk.block_file_bytes):
            cache.unlock(node)
            return LoadStart.BUSY
        slots = cache.reserve_host(n)
        bs, first = self.block_size, node.end
        keys = chain.keys(tokens, first + n)[first:]
        data = token_bytes(tokens[first * bs : (first + n) * bs], n * bs)
        per_block = [data[i * 4 * bs : (i + 1) * 4 * bs] for i in range(n)]
        self._unsubmitted.append((keys, per_block, slots, req_id))
        self._loads[req_id] = _Load(None, node, data, slots=slots)
        if earlier is not None:  # its blocks are on the path `node` locks now
            cache.unlock(earlier.node)
            self._loads[req_id].loaded_from = earlier.loaded[0]
        return LoadStart.STARTED

    def submit(self) -> None:
        """Hand the loads started since the last call to the loader thread. Call once the copies
        planned before them have run (their slots may have been read by those copies)."""
        for keys, tokens, slots, req_id in self._unsubmitted:
            job = self.disk.start_load(keys, tokens, slots)
            self._loads[req_id].job = job
            self._by_job[job] = req_id
        self._unsubmitted.clear()

    def poll(self) -> bool:
        """Take finished loads into the tree; True if any finished."""
        finished = self.disk.poll()
        for job in finished:
            req_id = self._by_job.pop(job)
            load = self._loads[req_id]
            cache = self.cache
            good = job.loaded
            spare = job.slots[good:]
            if load.cancelled or good == 0:
                cache.host.free(job.slots)
                cache.unlock(load.node)
                del self._loads[req_id]
                continue
            node, unused = cache.insert_host(load.node, load.tokens[: good * 4 * self.block_size], job.slots[:good])
            cache.host.free(unused + spare)
            cache.lock(node)
            cache.unlock(load.node)
            load.node = node
            load.done = True
            bs = self.block_size
            start = (node.end - good + len(unused)) * bs
            load.loaded = (start if load.loaded_from is None else min(start, load.loaded_from), node.end * bs)
        return bool(finished)

    def is_loading(self, req_id: Hashable) -> bool:
        load = self._loads.get(req_id)
        return load is not None and not load.done

    @property
    def has_pending(self) -> bool:
        """Loads submitted or waiting to be submitted."""
        return bool(self._by_job or self._unsubmitted)

    def release(self, req_id: Hashable, admitted_tokens: int) -> None:
        """The request no longer needs its loaded path locked (admitted, or gone)."""
        load = self._loads.get(req_id)
        if load is None:
            return
        if not load.done:
            load.cancelled = True
            if load.job is not None:
                load.job.cancelled = True  # the slots are freed when the loader is done with them
            return
        del self._loads[req_id]
        self.cache.unlock(load.node)
        start, end = load.loaded
        self.disk_hit_tokens += max(0, min(admitted_tokens, end) - start)

    # ------------------------------------------------------------------ checks

    def locked_nodes(self) -> list[RadixNode]:
        return [load.node for load in self._loads.values()]

    def held_slots(self) -> list[int]:
        """Host slots that in-flight loads hold (not yet in the tree)."""
        return [slot for load in self._loads.values() if not load.done for slot in load.slots]
