"""KV cache manager: per-request block tables over one block pool, prefix cache and host tier.

Plain Python + numpy; the engine thread is its only user (not thread safe).

Vocabulary: a request's *slots* are the token positions it has KV space for. `num_tokens(req)`
counts them: tokens already computed plus those being computed in the step being scheduled. The
slot of position p is `table[p // block_size] * block_size + p % block_size`.

How the scheduler uses it
-------------------------
Admit a waiting request::

    hit = mgr.match_prefix(prompt_ids)        # hit.num_tokens prompt tokens need no compute
    n = min(len(prompt_ids) - hit.num_tokens, token_budget)
    if mgr.admit(req_id, hit, n): ...         # False: not enough blocks above the watermark

  `hit.num_tokens` is a multiple of the block size and at most `len(prompt_ids) - 1`. Part of
  it may come back from the host tier (`hit.num_host_tokens`); `admit` plans those copies. A
  hit is only valid until the next call that changes the manager: admit right after matching.

Grow running requests, every step (chunked prefill: n = chunk; decode: n = 1)::

    ok = mgr.allocate_slots(req_id, n)        # False, nothing changed: preempt someone, retry
    table = mgr.block_table(req_id)           # int32, len == ceil(num_tokens / block_size)
    version = mgr.table_version(req_id)       # changes when entries of the table are replaced
    slots = mgr.slot_mapping(req_id, start, stop)

  New running-request growth may use the watermark reserve; admissions and swap-ins may not.
  Writing into a partly filled block that a fork shares copies it first (copy-on-write).

Before the step runs, hand the planned block copies to the runner::

    for stage in mgr.take_copies(): ...       # in order; see copy_plan.CopyPlan

After the step (the KV is written), cache what filled up::

    mgr.cache_full_blocks(req_id, token_ids)  # ids of the tokens whose KV is written, from 0

  Full blocks enter the prefix cache; where the cache already held the same tokens, the
  request switches to the cached block and its duplicate is freed.

Preempt: `free(req_id)` (recompute later: admit again, its cached blocks will hit) or
`swap_out(req_id)` (False when the host tier cannot take it; nothing changed). Resume a swapped
request with `swap_in(req_id)` (False: not enough device blocks). Finish: `cache_full_blocks`,
then `free`. Parallel sampling / beams: `fork(parent_id, child_id)` shares every block and the
child starts with the parent's `num_tokens`. Preempt and fork requests that are not scheduled in
the current round: slots allocated in a round count in `num_tokens` before the step writes them.

Peek without changing anything: `can_admit(hit, n)`, `can_allocate(req_id, n)`,
`can_swap_out(req_id)`, `can_swap_in(req_id)`, `num_available_blocks`.

Sessions: `pin(owner, history_ids, replacing=old_pin)` keeps the cached blocks of a history from
being evicted, within a per-owner budget (None when over it); `unpin(pin)` releases them.

Disk tier (`disk=`): `match_prefix` also reports `hit.num_disk_tokens`, the blocks after the
tree's match that are on disk. The scheduler may `start_load(req_id, hit)` instead of admitting:
the blocks are read into host slots in the background once `submit_loads()` is called after the
step's copies ran; `poll_loads()` (every step) puts finished
loads into the tree, and the request, no longer `is_loading`, is admitted with a host hit.
`cancel_load(req_id)` when a loading request goes away. Cached blocks are written to disk as the
copy plan's `DEVICE_TO_DISK` / `HOST_TO_DISK` entries (see `disk_link`); at a clean shutdown,
`flush_to_disk()` plans those the disk lacks.

KV handed between workers (prefill/decode disaggregation, see `holds`): `hold_prefix(ids)`
keeps a prompt's cached device blocks until `release_hold`; the receiving side writes pulled KV
into `allocate_import(n)` blocks and adds them with `adopt_import(hold, ids, blocks)`.

Metrics and checks: `usage()`, `stats` (prefix hits), `check_integrity()`.

Token ids must fit in int32 (the cache keys tokens as int32 bytes); numpy int32 arrays match
fastest, lists of ints cost ~0.1 us per matched token to convert.

Design notes. Requests lock the prefix-cache path of their cached leading blocks
(`cached_blocks`), so a block a request holds is never evicted under it. The cache adopts a block
only while one request holds it, so full blocks a fork shares enter the cache once the sharing
ends (one side finished or copied). Swap-out copies the whole table to the host (shared prefix
blocks too: simple, and the request comes back whole whatever the cache did meanwhile).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from jaxserve.kv.block_pool import RESERVED_BLOCK, BlockPool
from jaxserve.kv.content_keys import ChainKeys
from jaxserve.kv.copy_plan import CopyKind, CopyPlan, CopyStage
from jaxserve.kv.disk_link import DiskLink, LoadStart
from jaxserve.kv.disk_tier import DiskTier
from jaxserve.kv.holds import Hold
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.pins import Pin, PinLedger
from jaxserve.kv.radix_cache import CacheStats, RadixCache, RadixNode

RequestId = Hashable


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached prefix of a prompt, from `match_prefix`; pass it to `admit`."""

    num_tokens: int             # prompt tokens whose KV is cached (device + host)
    num_host_tokens: int        # the part of num_tokens that is copied back from the host tier
    num_prompt_tokens: int
    _node: RadixNode | None
    _device_blocks: list[int]
    _idle_path_blocks: int
    _epoch: int
    num_disk_tokens: int = 0    # after num_tokens: blocks on the disk tier (see start_load)
    _chain: ChainKeys | None = None
    _token_ids: Sequence[int] | np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class KVUsage:
    """Block counts. free + used + pinned + cached_idle == num_blocks (each block once)."""

    num_blocks: int         # usable device blocks (the reserved block 0 excluded)
    free: int               # on the free list
    used: int               # held by at least one request
    shared: int             # held by two or more requests
    cached: int             # stored in the prefix cache (some may also be used or pinned)
    cached_idle: int        # cached and held by no request or pin: reclaimable at once
    pinned: int             # cached, held by no request, kept by a pin
    host_slots: int
    host_swapped: int       # host slots holding swapped-out requests
    host_cached: int        # host slots holding spilled prefix-cache blocks
    host_free: int

    @property
    def available(self) -> int:
        """Blocks an allocation can get: free now or by evicting idle cache."""
        return self.free + self.cached_idle

    @classmethod
    def total(cls, usages: list[KVUsage]) -> KVUsage:
        """Field-by-field sums (the pools of several data-parallel replicas)."""
        return cls(*(sum(getattr(u, f.name) for u in usages) for f in fields(cls)))


class _Seq:
    __slots__ = ("table", "readonly_table", "num_blocks", "version", "num_tokens", "node", "cached_blocks",
                 "host_slots", "chain")

    def __init__(self, table: np.ndarray, num_blocks: int, version: int, num_tokens: int,
                 node: RadixNode | None, cached_blocks: int, chain: ChainKeys | None = None) -> None:
        self.table = table                  # int32 with spare capacity; [:num_blocks] is valid
        self.readonly_table = _readonly(table)  # what `block_table` slices (its views are read-only)
        self.num_blocks = num_blocks
        self.version = version              # see KVCacheManager.table_version
        self.num_tokens = num_tokens
        self.node = node                    # locked prefix-cache node covering [:cached_blocks]
        self.cached_blocks = cached_blocks
        self.host_slots: list[int] | None = None   # set while swapped out
        self.chain = chain                  # content keys of its blocks (with a disk tier)


def _readonly(table: np.ndarray) -> np.ndarray:
    view = table.view()
    view.flags.writeable = False
    return view


def _table_with(blocks: Sequence[int], capacity: int) -> np.ndarray:
    table = np.empty(max(capacity, 8), dtype=np.int32)
    table[:len(blocks)] = blocks
    return table


class KVCacheManager:
    """Block tables, admission, growth, copy-on-write, prefix reuse, swap and pins."""

    def __init__(self, num_blocks: int, block_size: int = 16, *,
                 watermark_blocks: int | None = None, enable_prefix_cache: bool = True,
                 num_host_slots: int = 0, spill_to_host: bool = True,
                 pin_budget_blocks: int | None = None,
                 max_pinned_blocks: int | None = None,
                 disk: DiskTier | None = None, disk_write_through_hits: int = 0) -> None:
        """
        watermark_blocks: free blocks that admissions and swap-ins must leave for running
            requests to grow into (default 1% of the pool).
        num_host_slots: capacity of the host tier in blocks (0 = no swapping, no spilling).
        spill_to_host: blocks evicted from the device prefix cache move to the host tier.
        pin_budget_blocks: most blocks one owner may pin (default 1/8 of the pool).
        max_pinned_blocks: most blocks all pins together may pin (default half the pool).
        disk: a disk tier under the host tier (needs the prefix cache and host slots).
        disk_write_through_hits: 0 = write every cached block to disk; N = once hit N times.
        """
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        usable = self.pool.num_usable
        self.watermark_blocks = usable // 100 if watermark_blocks is None else watermark_blocks
        if not 0 <= self.watermark_blocks < usable:
            raise ValueError(f"watermark_blocks must be in [0, {usable}), got {watermark_blocks}")
        self.copies = CopyPlan()
        self.host = HostTier(num_host_slots) if num_host_slots > 0 else None
        self.prefix_cache = (RadixCache(self.pool, self.host, self.copies,
                                        spill_to_host=spill_to_host)
                             if enable_prefix_cache else None)
        self.pins = PinLedger(usable // 8 if pin_budget_blocks is None else pin_budget_blocks,
                              usable // 2 if max_pinned_blocks is None else max_pinned_blocks)
        self._seqs: dict[RequestId, _Seq] = {}
        self._holds: set[Hold] = set()
        self._epoch = 0
        self._last_table_version = 0
        self.disk = None
        if disk is not None:
            if self.prefix_cache is None:
                raise ValueError("the disk tier needs the prefix cache")
            self.disk = DiskLink(disk, self.prefix_cache, self.copies, write_through_hits=disk_write_through_hits)

    # ------------------------------------------------------------------ queries

    def __contains__(self, req_id: RequestId) -> bool:
        return req_id in self._seqs

    def request_ids(self) -> list[RequestId]:
        return list(self._seqs)

    def num_tokens(self, req_id: RequestId) -> int:
        return self._get(req_id).num_tokens

    def is_swapped(self, req_id: RequestId) -> bool:
        return self._get(req_id).host_slots is not None

    def num_cached_blocks(self, req_id: RequestId) -> int:
        """Leading blocks of the request that are in the prefix cache."""
        return self._get(req_id).cached_blocks

    def block_table(self, req_id: RequestId) -> np.ndarray:
        """Read-only int32 view of the request's blocks (empty while swapped out)."""
        seq = self._get(req_id)
        return seq.readonly_table[:seq.num_blocks]

    def table_version(self, req_id: RequestId) -> int:
        """A number that changes whenever entries of the request's table change, not when blocks
        are appended: copy-on-write, a block swapped for the cache's copy, swap out and in, blocks
        released (they may come back different). It never repeats, across requests and a request
        admitted again, so a copy of the table with the same version and length is current."""
        return self._get(req_id).version

    def slot_mapping(self, req_id: RequestId, start: int, stop: int) -> np.ndarray:
        """int32 cache slots of token positions [start, stop) of a running request."""
        seq = self._running(req_id)
        if not 0 <= start <= stop <= seq.num_tokens:
            raise ValueError(f"positions [{start}, {stop}) outside the request's "
                             f"{seq.num_tokens} slots")
        bs = self.block_size
        block = start // bs
        if start == stop:
            return np.empty(0, dtype=np.int32)
        if stop - 1 < (block + 1) * bs:     # within one block (every decode): no gather
            base = int(seq.table[block]) * bs - block * bs
            return np.arange(base + start, base + stop, dtype=np.int32)
        positions = np.arange(start, stop, dtype=np.int32)
        return seq.table[positions // bs] * bs + positions % bs

    @property
    def stats(self) -> CacheStats:
        return self.prefix_cache.stats if self.prefix_cache is not None else CacheStats()

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus idle cached blocks that eviction would free."""
        cache = self.prefix_cache
        return self.pool.num_free + (cache.num_evictable_blocks if cache is not None else 0)

    def usage(self) -> KVUsage:
        """Counts for metrics; O(blocks), so call it per scrape, not per step."""
        holders = np.zeros(self.pool.num_blocks, dtype=np.int32)
        for seq in self._seqs.values():
            np.add.at(holders, seq.table[:seq.num_blocks], 1)
        cache = self.prefix_cache
        host = self.host
        swapped = sum(len(s.host_slots) for s in self._seqs.values() if s.host_slots is not None)
        pinned = 0
        if cache is not None:
            cached_blocks = np.fromiter(cache.device_blocks(), dtype=np.int64)
            cached_used = int((holders[cached_blocks] > 0).sum())
            pinned = cache.num_device_blocks - cache.num_evictable_blocks - cached_used
        return KVUsage(
            num_blocks=self.pool.num_usable,
            free=self.pool.num_free,
            used=int((holders > 0).sum()),
            shared=int((holders > 1).sum()),
            cached=cache.num_device_blocks if cache is not None else 0,
            cached_idle=cache.num_evictable_blocks if cache is not None else 0,
            pinned=pinned,
            host_slots=host.num_slots if host is not None else 0,
            host_swapped=swapped,
            host_cached=cache.num_host_blocks if cache is not None else 0,
            host_free=host.num_free if host is not None else 0,
        )

    # ------------------------------------------------------------------ admission

    def new_chain(self) -> ChainKeys | None:
        """Content keys for one request's tokens (None without a disk tier): pass the same one to
        every `match_prefix` of that request, so its keys are computed once."""
        return self.disk.new_chain() if self.disk is not None else None

    def match_prefix(self, token_ids: Sequence[int] | np.ndarray, chain: ChainKeys | None = None) -> PrefixHit:
        """Find the cached prefix of a prompt. Changes nothing a hit depends on."""
        cache = self.prefix_cache
        if cache is None:
            return PrefixHit(0, 0, len(token_ids), None, [], 0, self._epoch)
        match = cache.match(token_ids)
        disk_tokens = 0
        if self.disk is not None:
            chain = chain if chain is not None else self.disk.new_chain()
            limit = (len(token_ids) - 1) // self.block_size
            disk_tokens = self.disk.blocks_on_disk(token_ids, chain, match.num_blocks, limit) * self.block_size
        return PrefixHit(match.num_tokens, match.num_host_tokens, len(token_ids), match.node,
                         match.device_blocks, match.idle_device_blocks, self._epoch, disk_tokens, chain, token_ids)

    def _admit_need(self, hit: PrefixHit, num_new_tokens: int) -> int:
        if hit._epoch != self._epoch:
            raise ValueError("stale PrefixHit: the manager changed since match_prefix; match again")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        total_blocks = -(-(hit.num_tokens + num_new_tokens) // self.block_size)
        return total_blocks - len(hit._device_blocks)

    def can_admit(self, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Would `admit` succeed (leaving the watermark free for running requests)?"""
        need = self._admit_need(hit, num_new_tokens)
        available = self.num_available_blocks - hit._idle_path_blocks
        return available - need >= self.watermark_blocks

    def admit(self, req_id: RequestId, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Start a request: reuse the hit's cached blocks, add slots for `num_new_tokens`.

        Afterwards `num_tokens(req_id) == hit.num_tokens + num_new_tokens`. Returns False, with
        nothing changed, when the blocks needed would eat into the watermark.
        """
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is already admitted")
        if not self.can_admit(hit, num_new_tokens):
            return False
        need = self._admit_need(hit, num_new_tokens)
        self._epoch += 1
        cache = self.prefix_cache
        path = list(hit._device_blocks)
        node = hit._node
        if cache is not None:
            cache.lock(node)
            if self.disk is not None:
                self.disk.release(req_id, hit.num_tokens)
                self.disk.count_hits(hit._chain, hit._token_ids, hit._device_blocks)
            if hit.num_host_tokens:
                path += cache.load_to_device(node)
            cache.stats.record(hit.num_prompt_tokens, hit.num_tokens - hit.num_host_tokens,
                               hit.num_host_tokens)
        for block in path:
            self.pool.incref(block)
        new = self._allocate(need - hit.num_host_tokens // self.block_size)
        table = _table_with(path + new, 2 * (len(path) + len(new)))
        self._seqs[req_id] = _Seq(table, len(path) + len(new), self._new_table_version(),
                                  hit.num_tokens + num_new_tokens, node, len(path), hit._chain)
        return True

    # ------------------------------------------------------------------ disk loads

    def start_load(self, req_id: RequestId, hit: PrefixHit) -> LoadStart:
        """Read the hit's disk blocks into the host tier in the background, instead of admitting.

        STARTED: `is_loading(req_id)` until a later `poll_loads()`; then match and admit again (a
        match that still continues on disk, when the host tier had room for part of it, may load again).
        BUSY: the in-flight bound is reached, try again later. NONE: no room; admit and recompute.
        """
        if self.disk is None or not hit.num_disk_tokens:
            return LoadStart.NONE
        if hit._epoch != self._epoch:
            raise ValueError("stale PrefixHit: the manager changed since match_prefix; match again")
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is already admitted")
        result = self.disk.start_load(req_id, hit._node, hit._token_ids, hit._chain,
                                      hit.num_disk_tokens // self.block_size)
        if result is LoadStart.STARTED:
            self._epoch += 1
        return result

    def submit_loads(self) -> None:
        """Start the reads of loads begun since the last call: call it after the copies taken
        with `take_copies` have run (the runner's launch), or when there were none."""
        if self.disk is not None:
            self.disk.submit()

    def poll_loads(self) -> bool:
        """Put finished disk loads into the prefix cache; True if any finished."""
        if self.disk is None or not self.disk.poll():
            return False
        self._epoch += 1
        return True

    def is_loading(self, req_id: RequestId) -> bool:
        return self.disk is not None and self.disk.is_loading(req_id)

    @property
    def has_pending_loads(self) -> bool:
        return self.disk is not None and self.disk.has_pending

    def flush_to_disk(self) -> int:
        """At a clean shutdown: plan disk writes of the cached blocks the disk tier lacks, within
        its budget (see `DiskLink.flush`); run the copies, then close the tier. Returns the blocks
        planned (0 without a disk tier)."""
        return self.disk.flush() if self.disk is not None else 0

    def cancel_load(self, req_id: RequestId) -> None:
        """The request went away: release what its load holds (a no-op if it has none)."""
        if self.disk is not None:
            self._epoch += 1
            self.disk.release(req_id, 0)

    # ------------------------------------------------------------------ growth

    def _growth_need(self, seq: _Seq, num_new_tokens: int) -> tuple[int, bool]:
        """(blocks to allocate, whether the last block must be copied before writing)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        new_blocks = -(-(seq.num_tokens + num_new_tokens) // bs) - seq.num_blocks
        cow = (num_new_tokens > 0 and seq.num_tokens % bs != 0
               and self.pool.refcount[seq.table[seq.num_blocks - 1]] > 1)
        return new_blocks + cow, cow

    def can_allocate(self, req_id: RequestId, num_new_tokens: int) -> bool:
        """Would `allocate_slots` succeed? (Running requests may use the watermark reserve.)"""
        need, _ = self._growth_need(self._running(req_id), num_new_tokens)
        return need <= self.num_available_blocks

    def allocate_slots(self, req_id: RequestId, num_new_tokens: int) -> bool:
        """Add `num_new_tokens` slots to a running request; False (nothing changed) if short.

        A shared, partly filled last block is copied first (copy-on-write): the copy is planned
        and shows up in `take_copies()`.
        """
        seq = self._running(req_id)
        need, cow = self._growth_need(seq, num_new_tokens)
        self._epoch += 1
        if need == 0:
            seq.num_tokens += num_new_tokens
            return True
        if need > self.num_available_blocks:
            return False
        blocks = self._allocate(need)
        if cow:
            last = seq.num_blocks - 1
            shared = int(seq.table[last])
            copy = blocks.pop()
            self.copies.add(CopyKind.DEVICE_TO_DEVICE, shared, copy)
            self.pool.decref(shared)
            seq.table[last] = copy
            seq.version = self._new_table_version()
        self._append_blocks(seq, blocks)
        seq.num_tokens += num_new_tokens
        return True

    def release_slots(self, req_id: RequestId, num_tokens: int) -> None:
        """Shrink a running request to its first `num_tokens` slots, freeing the blocks past them
        (speculative decoding: the slots of rejected draft tokens). Cached blocks are kept: they
        only ever hold computed tokens."""
        seq = self._running(req_id)
        bs = self.block_size
        if not seq.cached_blocks * bs <= num_tokens <= seq.num_tokens:
            raise ValueError(f"cannot shrink {req_id!r} from {seq.num_tokens} to {num_tokens} slots "
                             f"({seq.cached_blocks} cached blocks)")
        keep = -(-num_tokens // bs)
        self._epoch += 1
        if keep < seq.num_blocks:
            self.pool.decref_all(seq.table[keep:seq.num_blocks].tolist())
            seq.num_blocks = keep
            seq.version = self._new_table_version()
        seq.num_tokens = num_tokens

    def _append_blocks(self, seq: _Seq, blocks: list[int]) -> None:
        end = seq.num_blocks + len(blocks)
        if end > len(seq.table):
            grown = np.empty(max(2 * len(seq.table), end), dtype=np.int32)
            grown[:seq.num_blocks] = seq.table[:seq.num_blocks]
            seq.table, seq.readonly_table = grown, _readonly(grown)
        seq.table[seq.num_blocks:end] = blocks
        seq.num_blocks = end

    def _allocate(self, n: int) -> list[int]:
        if self.prefix_cache is not None:
            return self.prefix_cache.allocate(n)
        return self.pool.allocate(n)

    # ------------------------------------------------------------------ prefix caching

    def cache_full_blocks(self, req_id: RequestId, token_ids: Sequence[int] | np.ndarray) -> int:
        """Put the request's newly filled blocks into the prefix cache.

        `token_ids` are the request's tokens from position 0 whose KV has been written (call
        after the step). Cheap when no block filled since the last call. Returns how many
        leading blocks of the request are now cached. A no-op without a prefix cache.
        """
        seq = self._running(req_id)
        cache = self.prefix_cache
        if cache is None:
            return 0
        if len(token_ids) > seq.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids but only {seq.num_tokens} slots")
        bs = self.block_size
        full = len(token_ids) // bs
        done = seq.cached_blocks
        if full <= done:
            return done
        self._epoch += 1
        table = seq.table
        result = cache.insert(token_ids[done * bs:full * bs], table[done:full].tolist(),
                              parent=seq.node)
        cache.unlock(seq.node)
        seq.node = result.node
        pool = self.pool
        adopted = []
        for i, cached in enumerate(result.blocks, start=done):
            own = int(table[i])
            if cached != own:       # the cache had these tokens already: use its block
                pool.incref(cached)
                pool.decref(own)
                table[i] = cached
                seq.version = self._new_table_version()
            elif self.disk is not None:
                adopted.append(i)
        if adopted:
            if seq.chain is None:
                seq.chain = self.disk.new_chain()
            self.disk.write_through(seq.chain, token_ids, {i: int(table[i]) for i in adopted})
        seq.cached_blocks = done + len(result.blocks)
        return seq.cached_blocks

    def clear_prefix_cache(self) -> int:
        """Drop every cached block no request or pin holds (both tiers); returns blocks freed."""
        if self.prefix_cache is None:
            return 0
        self._epoch += 1
        return self.prefix_cache.clear()

    # ------------------------------------------------------------------ fork, free

    def fork(self, parent_id: RequestId, child_id: RequestId) -> None:
        """Make `child_id` share every block of `parent_id` (copy-on-write on the partial one)."""
        if child_id in self._seqs:
            raise ValueError(f"request {child_id!r} already exists")
        parent = self._running(parent_id)
        self._epoch += 1
        blocks = parent.table[:parent.num_blocks]
        pool = self.pool
        for block in blocks.tolist():
            pool.incref(block)
        if self.prefix_cache is not None:
            self.prefix_cache.lock(parent.node)
        chain = parent.chain.fork() if parent.chain is not None else None
        self._seqs[child_id] = _Seq(_table_with(blocks, len(parent.table)), parent.num_blocks,
                                    self._new_table_version(), parent.num_tokens, parent.node,
                                    parent.cached_blocks, chain)

    def free(self, req_id: RequestId) -> None:
        """Release everything the request holds (finish, abort, or preempt-to-recompute)."""
        seq = self._get(req_id)
        self._epoch += 1
        del self._seqs[req_id]
        if seq.host_slots is not None:
            self.host.free(seq.host_slots)
            return
        self.pool.decref_all(seq.table[:seq.num_blocks].tolist())
        if self.prefix_cache is not None:
            self.prefix_cache.unlock(seq.node)

    # ------------------------------------------------------------------ swap

    def can_swap_out(self, req_id: RequestId) -> bool:
        n = self._running(req_id).num_blocks
        if self.host is None:
            return False
        if self.prefix_cache is not None:
            return self.prefix_cache.can_reserve_host(n)
        return self.host.num_free >= n

    def swap_out(self, req_id: RequestId) -> bool:
        """Preempt by copying the request's blocks to host slots and freeing them on the device.

        Cached host blocks are evicted to make room if needed. False (nothing changed) when the
        host tier cannot take the request.
        """
        if not self.can_swap_out(req_id):
            return False
        seq = self._seqs[req_id]
        self._epoch += 1
        n = seq.num_blocks
        slots = (self.prefix_cache.reserve_host(n) if self.prefix_cache is not None
                 else self.host.allocate(n))
        blocks = seq.table[:n].tolist()
        for block, slot in zip(blocks, slots):
            self.copies.add(CopyKind.DEVICE_TO_HOST, block, slot)
        self.pool.decref_all(blocks)
        if self.prefix_cache is not None:
            self.prefix_cache.unlock(seq.node)
            seq.node = self.prefix_cache.root
        seq.host_slots = slots
        seq.num_blocks = 0
        seq.version = self._new_table_version()
        seq.cached_blocks = 0
        return True

    def can_swap_in(self, req_id: RequestId) -> bool:
        seq = self._get(req_id)
        if seq.host_slots is None:
            raise ValueError(f"request {req_id!r} is not swapped out")
        return self.num_available_blocks - len(seq.host_slots) >= self.watermark_blocks

    def swap_in(self, req_id: RequestId) -> bool:
        """Bring a swapped-out request back; False (nothing changed) if the device is too full."""
        if not self.can_swap_in(req_id):
            return False
        seq = self._seqs[req_id]
        self._epoch += 1
        slots = seq.host_slots
        blocks = self._allocate(len(slots))
        for slot, block in zip(slots, blocks):
            self.copies.add(CopyKind.HOST_TO_DEVICE, slot, block)
        self.host.free(slots)
        seq.host_slots = None
        self._append_blocks(seq, blocks)
        seq.version = self._new_table_version()
        return True

    def take_copies(self) -> list[CopyStage]:
        """Block copies planned since the last call, as ordered stages: run them before the step."""
        return self.copies.take()

    # ------------------------------------------------------------------ pins

    def pin(self, owner: Hashable, token_ids: Sequence[int] | np.ndarray, *,
            replacing: Pin | None = None) -> Pin | None:
        """Keep the cached full blocks of `token_ids` from eviction, for `owner`.

        Pins what is cached now (on either tier). Returns None, with nothing changed, if it would
        exceed the owner's budget or the pool-wide cap. `replacing` (a pin to release at the same
        time, e.g. a session's previous history) does not count against the budget.
        """
        if replacing is not None and not replacing.active:
            raise ValueError("replacing a pin that is not active")
        cache = self.prefix_cache
        match = cache.match(token_ids, leave_last_token=False) if cache is not None else None
        num_blocks = match.num_blocks if match is not None else 0
        if not self.pins.fits(owner, num_blocks, replacing):
            return None
        self._epoch += 1
        node = match.node if match is not None else None
        if cache is not None:
            cache.lock(node)
        pin = Pin(owner, num_blocks, num_blocks * self.block_size, node)
        self.pins.add(pin)
        if replacing is not None:
            self.unpin(replacing)
        return pin

    def pin_within_budget(self, owner: Hashable, token_ids: Sequence[int], old: Pin | None,
                          others: list[Pin]) -> tuple[Pin | None, list[Pin]]:
        """Pin `token_ids` for `owner` replacing `old` (a session's previous history), unpinning
        `others` (the owner's other pins, least recently used first) as needed to fit its budget.
        Returns the new pin (None if even alone it does not fit) and the pins released. Pins in
        `others` that this manager does not hold (another replica's) are left alone."""
        others = [p for p in others if self.pins.holds(p)]
        if old is not None and not old.active:
            old = None
        released = []
        pin = self.pin(owner, token_ids, replacing=old)
        if pin is None and others and self.prefix_cache is not None:
            needed = self.prefix_cache.match(token_ids, leave_last_token=False).num_blocks
            if needed <= self.pins.budget_per_owner:  # else hopeless even alone: keep the others
                for other in others:
                    if not other.active:
                        continue
                    self.unpin(other)
                    released.append(other)
                    pin = self.pin(owner, token_ids, replacing=old)
                    if pin is not None:
                        break
        if pin is None and old is not None:
            self.unpin(old)  # the old history is stale now; do not keep it pinned either
            released.append(old)
        return pin, released

    def unpin(self, pin: Pin) -> None:
        self.pins.remove(pin)
        self._epoch += 1
        if self.prefix_cache is not None:
            self.prefix_cache.unlock(pin.node)

    # ------------------------------------------------------------------ holds

    def hold_prefix(self, token_ids: Sequence[int] | np.ndarray, max_blocks: int | None = None) -> Hold:
        """Hold the cached device blocks that start `token_ids` (its full blocks, at most
        `max_blocks`): not evicted until `release_hold`. Blocks spilled to the host are left out
        (they follow the device ones). Empty without a prefix cache."""
        self._epoch += 1
        cache = self.prefix_cache
        if cache is None:
            hold = Hold([])
        else:
            n = len(token_ids) if max_blocks is None else min(len(token_ids), max_blocks * self.block_size)
            node = cache.match(token_ids[:n], leave_last_token=False).node
            while node.blocks is None:
                node = node.parent
            cache.lock(node)
            hold = Hold(cache.path_blocks(node), node)
        self._holds.add(hold)
        return hold

    def release_hold(self, hold: Hold) -> None:
        if not hold.active or hold not in self._holds:
            raise ValueError("release of a hold that is not active")
        self._epoch += 1
        self._holds.remove(hold)
        hold.active = False
        if self.prefix_cache is not None:
            self.prefix_cache.unlock(hold.node)

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    def allocate_import(self, n: int) -> list[int]:
        """Up to `n` fresh blocks for KV read from another engine: fewer (maybe none) where more
        would eat into the watermark. Write their KV, then `adopt_import` them. Evicting idle
        cached blocks for them may plan copies: run `take_copies()` before writing."""
        self._epoch += 1
        return self._allocate(max(0, min(n, self.num_available_blocks - self.watermark_blocks)))

    def adopt_import(self, hold: Hold, token_ids: Sequence[int] | np.ndarray, blocks: list[int]) -> Hold:
        """Add `blocks` (from `allocate_import`, KV written) to the prefix cache after the path
        `hold` holds: blocks[i] has the KV of block `hold.num_blocks + i` of `token_ids`.
        Returns a hold of the longer path, which replaces `hold`. Blocks whose tokens the cache
        has already go back to the pool."""
        if not hold.active:
            raise ValueError("adopt_import after a hold that is not active")
        cache = self.prefix_cache
        if cache is None:
            raise ValueError("imported blocks go into the prefix cache: enable it")
        bs, first = self.block_size, hold.num_blocks
        self._epoch += 1
        result = cache.insert(token_ids[first * bs:(first + len(blocks)) * bs], blocks, parent=hold.node)
        self.pool.decref_all(blocks)
        longer = Hold(hold.blocks + result.blocks, result.node)
        self._holds.add(longer)
        self.release_hold(hold)
        return longer

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Check the invariants of pool, tables, cache, host tier and pins (AssertionError)."""
        pool = self.pool
        cache = self.prefix_cache
        holders: Counter[int] = Counter()
        locks: Counter[RadixNode] = Counter()
        host_held: list[int] = []
        bs = self.block_size
        for req_id, seq in self._seqs.items():
            if seq.host_slots is not None:
                if seq.num_blocks or len(seq.host_slots) != -(-seq.num_tokens // bs):
                    raise AssertionError(f"swapped request {req_id!r}: slots do not cover tokens")
                host_held += seq.host_slots
                continue
            blocks = seq.table[:seq.num_blocks].tolist()
            if len(blocks) != -(-seq.num_tokens // bs):
                raise AssertionError(f"request {req_id!r}: {len(blocks)} blocks for "
                                     f"{seq.num_tokens} tokens")
            if len(set(blocks)) != len(blocks) or RESERVED_BLOCK in blocks:
                raise AssertionError(f"request {req_id!r}: repeated or reserved block in table")
            holders.update(blocks)
            if cache is not None:
                locks[seq.node] += 1
                if seq.node.end != seq.cached_blocks:
                    raise AssertionError(f"request {req_id!r}: locked node ends at block "
                                         f"{seq.node.end}, cached_blocks {seq.cached_blocks}")
                if cache.path_blocks(seq.node) != blocks[:seq.cached_blocks]:
                    raise AssertionError(f"request {req_id!r}: cached blocks differ from the tree")
            elif seq.cached_blocks:
                raise AssertionError("cached blocks without a prefix cache")
        if cache is not None:
            holders.update(cache.device_blocks())
            host_held += list(cache.host_slots())
            for pin in self.pins.pins():
                locks[pin.node] += 1
            for hold in self._holds:
                locks[hold.node] += 1
            if self.disk is not None:
                for node in self.disk.locked_nodes():
                    locks[node] += 1
                host_held += self.disk.held_slots()
                self.disk.disk.check_integrity()
            del locks[cache.root]
            cache.check_integrity(dict(locks))
        pool.check_integrity([holders.get(block, 0) for block in range(pool.num_blocks)])
        if self.host is not None:
            self.host.check_integrity(host_held)
        elif host_held:
            raise AssertionError("host slots held without a host tier")
        self.pins.check_integrity()

    # ------------------------------------------------------------------ helpers

    def _get(self, req_id: RequestId) -> _Seq:
        seq = self._seqs.get(req_id)
        if seq is None:
            raise KeyError(f"unknown request {req_id!r}")
        return seq

    def _new_table_version(self) -> int:
        self._last_table_version += 1
        return self._last_table_version

    def _running(self, req_id: RequestId) -> _Seq:
        seq = self._get(req_id)
        if seq.host_slots is not None:
            raise ValueError(f"request {req_id!r} is swapped out; swap_in first")
        return seq
