"""The prefix cache's link to the tier below the host tier (a `KVTier`: the disk tier, the pool
tier, or `TierChain` over both):
content keys, writes to the tier, and background loads from it into the host tier. It reaches the
cache only through `SpillingPrefixCache` and the tier only through `KVTier`.

Writes. Every write is planned into the copy plan (`DEVICE_TO_DISK` / `HOST_TO_DISK`, with a
ticket of the tier as destination), so the runner reads the block exactly when its turn in
the plan comes: after the copies that filled it, before any later one that reuses its space.
- write-through: with `write_through_hits == 0` every block is written when it enters the prefix
  cache; with N > 0 once it has been part of N admitted hits (HiCache's selective
  write-through: only what is reused pays for the disk);
- write-back: a cached block leaving the device without a host slot, or leaving the host tier,
  is written if the tier does not hold it yet.

Loads. A prompt whose cache match ends where the tier continues it (its next blocks' keys are
stored there) can start a load: host slots are reserved, the matched path is locked, and once
the copies planned so far have run (`submit`: a host slot freed this round may still be read by one of
them, a host -> device copy or a write-back) the tier reads the blocks into the host slots. When the job is
done (`poll`), the blocks that read back whole join the cache as idle host blocks locked for the
request, and the request's next match finds them on the host tier; admission copies them to the
device as any host hit.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxserve.kv.content_keys import (
    TOKEN_BYTES,
    ChainKeys,
    PathSeeds,
    chain_keys,
    content_token_bytes,
    next_key,
    token_bytes,
)
from jaxserve.kv.copy_plan import CopyKind, CopyPlan
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.kv_tier import KVTier, LoadJob
from jaxserve.kv.prefix_cache import CachedPath, DroppedBlocks, SpillingPrefixCache

MAX_HIT_COUNTS = 1 << 20  # distinct keys counted for selective write-through before a reset


class LoadStart(enum.Enum):
    STARTED = "started"  # the request waits for its blocks
    BUSY = "busy"  # loads in flight use the byte bound: try again next step
    NONE = "none"  # nothing to load (or no host room): recompute instead


@runtime_checkable
class LowerTierLink(Protocol):
    """What the KV manager and `TierLoads` ask of the link to a tier below the host tier:
    `TierLink`, or `no_tier_link.NoTierLink` when there is no such tier."""

    block_size: int
    seeds: PathSeeds  # the seed of each cached path's keys (LoRA paths' salted ones)

    def new_chain(self) -> ChainKeys: ...

    def blocks_stored(self, tokens: Sequence[int] | np.ndarray, chain: ChainKeys, first: int, limit: int) -> int: ...

    def write_through(self, chain: ChainKeys, tokens: Sequence[int] | np.ndarray, blocks: dict[int, int]) -> None: ...

    def count_hits(
        self, chain: ChainKeys, tokens: Sequence[int] | np.ndarray, device_blocks: Sequence[int]
    ) -> None: ...

    def flush(self) -> int: ...

    def start_load(
        self, req_id: Hashable, path: CachedPath, tokens: Sequence[int] | np.ndarray, chain: ChainKeys, num_blocks: int
    ) -> LoadStart: ...

    def submit(self) -> None: ...

    def poll(self) -> bool: ...

    def is_loading(self, req_id: Hashable) -> bool: ...

    @property
    def has_pending(self) -> bool: ...

    def release(self, req_id: Hashable, admitted_tokens: int) -> None: ...

    def locked_paths(self) -> list[CachedPath]: ...

    def held_host_slots(self) -> list[int]: ...

    def check_integrity(self) -> None: ...

    def tier_stats(self) -> dict[str, Any]: ...


@dataclass(eq=False)
class _Load:
    job: LoadJob | None  # None until submitted
    path: CachedPath  # locked for the request: the matched path, then the loaded one
    tokens: bytes  # the loaded blocks' cache tokens (int32 bytes; a LoRA path's first one salted)
    host_slots: list[int]  # host slots the load holds until it is done
    done: bool = False
    cancelled: bool = False
    # (tier kind, start, end): token positions the load added to the cache, by the tier that read
    # them; with those of an earlier load of the same request (a prefix loaded in parts, when the
    # host tier had room for only some of it). The tier hits counted at admission.
    loaded: list[tuple[str, int, int]] = field(default_factory=list)


class TierLink:
    """One prefix cache's link to one `KVTier` (see the module docstring)."""

    def __init__(
        self,
        tier: KVTier,
        cache: SpillingPrefixCache,
        host: HostTier,
        copies: CopyPlan,
        *,
        write_through_hits: int = 0,
    ) -> None:
        if host.num_host_slots == 0:
            raise ValueError("the disk tier loads through the host tier: give it host slots")
        if write_through_hits < 0:
            raise ValueError(f"write_through_hits must be >= 0, got {write_through_hits}")
        self.tier = tier
        self.cache = cache
        self.host = host
        self.copies = copies
        self.block_size = cache.block_size
        self.write_through_hits = write_through_hits
        self.hit_tokens_by_tier: dict[str, int] = {}  # prompt tokens admitted from blocks a tier loaded, by kind
        self._loads: dict[Hashable, _Load] = {}
        self._by_job: dict[LoadJob, Hashable] = {}
        self._unsubmitted: list[tuple[list[bytes], list[bytes], list[int], Hashable]] = []
        self._hits: dict[bytes, int] = {}
        self.seeds = PathSeeds(tier.fingerprint)
        cache.on_drop = self._write_back

    def new_chain(self) -> ChainKeys:
        return ChainKeys(self.seeds.seed, self.block_size)

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens admitted from blocks the tier (any tier of a chain) loaded."""
        return sum(self.hit_tokens_by_tier.values())

    # ------------------------------------------------------------------ lookups

    def blocks_stored(self, tokens: Sequence[int] | np.ndarray, chain: ChainKeys, first: int, limit: int) -> int:
        """How many blocks from block `first` (below `limit`) continue in the tier."""
        if first >= limit:
            return 0
        if not self.tier.contains(chain.keys(tokens, first + 1)[first]):
            return 0
        return 1 + self.tier.num_leading(chain.keys(tokens, limit)[first + 1 :])

    # ------------------------------------------------------------------ writes

    def _plan(self, kind: CopyKind, src: int, key: bytes, tokens: bytes) -> bool:
        """Plan writing one block; False when it is stored already or being written."""
        ticket = self.tier.plan_write(key, tokens)
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
            self._plan(CopyKind.DEVICE_TO_DISK, block, keys[i], content_token_bytes(tokens, i * bs, (i + 1) * bs))

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
                self._plan(CopyKind.DEVICE_TO_DISK, block, key, content_token_bytes(tokens, i * bs, (i + 1) * bs))
            else:
                self._hits[key] = count

    def _write_back(self, dropped: DroppedBlocks) -> None:
        """The cache drops blocks: write those the tier lacks."""
        tokens, first, bs = dropped.tokens, dropped.first, self.block_size
        seed = self.seeds.of(tokens)
        if seed is None:  # a LoRA path no request keyed (cannot happen: they enter through requests)
            return
        keys = chain_keys(seed, tokens, first + len(dropped.locations), bs)
        kind = CopyKind.DEVICE_TO_DISK if dropped.on_device else CopyKind.HOST_TO_DISK
        for i, location in enumerate(dropped.locations, start=first):
            self._plan(kind, location, keys[i], content_token_bytes(tokens, i * bs, (i + 1) * bs))

    def flush(self) -> int:
        """At a clean shutdown: plan writes of the cached blocks (device and host tier) the tier
        lacks, so the next engine finds them. Most recently used first, and no more blocks than
        the tier holds, counting the cached blocks already stored (those are touched, so the new
        ones evict older ones, never them). Written oldest first, so the tier's LRU order (and the
        file times the disk tier's next start sorts by) follows the cache's.
        Returns the blocks planned for writing."""
        tier, kb = self.tier, self.block_size * TOKEN_BYTES
        room = tier.capacity_blocks
        keys: dict[CachedPath, bytes] = {}  # last key of each run's path
        chosen: list[tuple[bytes, CopyKind, int, bytes]] = []
        for run in self.cache.runs_by_recency():
            if len(chosen) == room:
                break
            ids = np.frombuffer(run.tokens, dtype=np.int32)
            at_root = run.parent is self.cache.root
            key = self.seeds.of(ids) if at_root else keys.get(run.parent)
            if key is None:  # under a LoRA path no request keyed
                continue
            data = content_token_bytes(ids, 0, len(ids)) if at_root else run.tokens
            kind = CopyKind.DEVICE_TO_DISK if run.on_device else CopyKind.HOST_TO_DISK
            for j in range(min(len(run.locations), room - len(chosen))):
                block_tokens = data[j * kb : (j + 1) * kb]
                key = next_key(key, block_tokens)
                chosen.append((key, kind, run.locations[j], block_tokens))
            keys[run.path] = key
        planned = 0
        for key, kind, location, block_tokens in reversed(chosen):
            if self._plan(kind, location, key, block_tokens):  # to each tier (of a chain) that lacks it
                planned += 1
            else:
                tier.touch(key)
        return planned

    # ------------------------------------------------------------------ loads

    def start_load(
        self, req_id: Hashable, path: CachedPath, tokens: Sequence[int] | np.ndarray, chain: ChainKeys, num_blocks: int
    ) -> LoadStart:
        """Load the `num_blocks` blocks after `path` (the request's cache match) from the tier.

        A request whose earlier load is done but that was not admitted yet (its match still
        continues in the tier: the host tier had room for only part of it) loads the rest; its
        earlier load's lock is handed over once the new one has started."""
        earlier = self._loads.get(req_id)
        if earlier is not None and not earlier.done:
            raise ValueError(f"request {req_id!r} is loading already")
        cache = self.cache
        cache.lock(path)  # before reserving host slots: reserving may evict idle host blocks
        n = min(num_blocks, self.host.num_free + cache.num_evictable_host_blocks)
        if n <= 0:
            cache.unlock(path)
            return LoadStart.NONE
        if not self.tier.can_load(n):
            cache.unlock(path)
            return LoadStart.BUSY
        host_slots = cache.reserve_host(n)
        self.seeds.note(chain, tokens)
        bs, first, kb = self.block_size, path.end, self.block_size * TOKEN_BYTES
        keys = chain.keys(tokens, first + n)[first:]
        data = content_token_bytes(tokens, first * bs, (first + n) * bs)  # as the tier stores them
        per_block = [data[i * kb : (i + 1) * kb] for i in range(n)]
        self._unsubmitted.append((keys, per_block, host_slots, req_id))
        cache_tokens = token_bytes(tokens[first * bs : (first + n) * bs], n * bs)  # the path's, salted
        self._loads[req_id] = _Load(None, path, cache_tokens, host_slots=host_slots)
        if earlier is not None:  # its blocks are on the path locked now
            cache.unlock(earlier.path)
            self._loads[req_id].loaded = earlier.loaded
        return LoadStart.STARTED

    def submit(self) -> None:
        """Hand the loads started since the last call to the tier. Call once the copies planned
        before them have run (their host slots may have been read by those copies)."""
        for keys, tokens, host_slots, req_id in self._unsubmitted:
            job = self.tier.start_load(keys, tokens, host_slots)
            self._loads[req_id].job = job
            self._by_job[job] = req_id
        self._unsubmitted.clear()

    def poll(self) -> bool:
        """Take finished loads into the cache; True if any finished."""
        finished = self.tier.poll()
        cache, bs = self.cache, self.block_size
        for job in finished:
            req_id = self._by_job.pop(job)
            load = self._loads[req_id]
            good = job.loaded
            if load.cancelled or good == 0:
                self.host.free(job.host_slots)
                cache.unlock(load.path)
                del self._loads[req_id]
                continue
            path, unused = cache.insert_host(load.path, load.tokens[: good * bs * TOKEN_BYTES], job.host_slots[:good])
            self.host.free(unused + job.host_slots[good:])
            cache.lock(path)
            cache.unlock(load.path)
            load.path = path
            load.done = True
            sources = job.sources or [(self.tier.kind, len(job.keys))]
            load.loaded.extend(_loaded_ranges(sources, path.end - good, len(unused), good, bs))
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
                load.job.cancelled = True  # the host slots are freed when the loader is done with them
            return
        del self._loads[req_id]
        self.cache.unlock(load.path)
        for kind, start, end in load.loaded:
            hits = max(0, min(admitted_tokens, end) - start)
            self.hit_tokens_by_tier[kind] = self.hit_tokens_by_tier.get(kind, 0) + hits

    # ------------------------------------------------------------------ checks

    def locked_paths(self) -> list[CachedPath]:
        return [load.path for load in self._loads.values()]

    def held_host_slots(self) -> list[int]:
        """Host slots that in-flight loads hold (not yet in the cache)."""
        return [host_slot for load in self._loads.values() if not load.done for host_slot in load.host_slots]

    def check_integrity(self) -> None:
        self.tier.check_integrity()

    def tier_stats(self) -> dict[str, Any]:
        """The `TierStats` fields of each tier below the host tier (`<kind>_*`: disk_*, pool_*)."""
        fields: dict[str, Any] = {"lower_tiers": tuple(t.kind for t in self.tier.tiers)}
        for t in self.tier.tiers:
            s = t.stats
            counters = dict(
                hit_tokens=self.hit_tokens_by_tier.get(t.kind, 0),
                evictions=s.evictions,
                loads=s.loads,
                loaded_blocks=s.loaded_blocks,
                load_seconds=s.load_seconds,
                load_seconds_counts=tuple(s.load_seconds_counts),
                bytes_read=s.bytes_read,
                bytes_written=s.bytes_written,
                written_blocks=s.written_blocks,
                write_seconds=s.write_seconds,
                damaged=s.damaged,
                files=t.num_blocks,
                bytes=t.num_bytes,
            )
            fields.update((f"{t.kind}_{name}", value) for name, value in counters.items())
        return fields


def _loaded_ranges(
    sources: list[tuple[str, int]], base: int, skip: int, good: int, block_size: int
) -> list[tuple[str, int, int]]:
    """(tier kind, start, end) token positions of a load's first `good` blocks, at block `base` on,
    the first `skip` of them left out (the cache had them already), by the tier that read them."""
    ranges, first = [], 0
    for kind, n in sources:
        lo, hi = max(first, skip), min(first + n, good)
        if lo < hi:
            ranges.append((kind, (base + lo) * block_size, (base + hi) * block_size))
        first += n
    return ranges
