"""KV cache manager: sequences' block tables over one block pool, prefix cache and tiers.

Plain Python + numpy; the engine thread is its only user (not thread safe). A sequence's block
table is a `KVHandle` (`block_table.py`) that its request owns; the manager makes handles and
edits the handle it is given. How the scheduler uses it, every step:

    hit = mgr.match_prefix(prompt_ids, chain)  # cached prefix; valid until the next change
    req.kv = mgr.admit(hit, n)                 # None: it would eat into the watermark
    ok = mgr.allocate_slots(req.kv, n)         # grow (decode: 1, a chunk: n); False: preempt, retry
    stages = mgr.take_copies()                 # copy-on-write, swap and spill copies, before the step
    mgr.cache_full_blocks(req.kv, token_ids)   # after the step: filled blocks join the prefix cache

Preempt with `free(handle)` (recompute: admit again later, the cached blocks will hit) or
`swap_out(handle)`, resumed by `swap_in(handle)`. `fork(handle)` shares every block (parallel
sampling); a write into a shared partial block copies it first. A handle's `version` changes when
entries of its table are replaced (not when blocks are appended), so a copy of a table with the
same version and length is current. Running sequences may grow into the watermark reserve;
admissions and swap-ins may not. `can_admit`, `can_allocate`, `can_swap_in/out` peek.

Sessions and KV handed between workers keep cached blocks through `leases` (`leases.py`).
With a disk tier, `match_prefix` also reports the blocks after the tree's match that are on disk;
the scheduler may `loads.start(key, hit)` them into the host tier instead of admitting, then admit
once `loads.poll()` has put them in the tree (`disk_loads.py`).
Cached blocks are written to disk as the copy plan's `*_TO_DISK` stages (`disk_link.py`).

Design notes. A sequence locks the prefix-cache path of its cached leading blocks
(`cached_blocks`), so a block it holds is never evicted under it. The cache adopts a block only
while one sequence holds it, so full blocks a fork shares enter the cache once the sharing ends.
Swap-out copies the whole table to the host (shared prefix blocks too: simple, and the sequence
comes back whole whatever the cache did meanwhile). Token ids must fit in int32 (the cache keys
tokens as int32 bytes); numpy int32 arrays match fastest.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from jaxserve.kv.accounting import KVUsage, check_integrity, kv_usage
from jaxserve.kv.block_pool import BlockPool
from jaxserve.kv.block_table import KVHandle
from jaxserve.kv.content_keys import KEY_BYTES, ChainKeys
from jaxserve.kv.copy_plan import CopyKind, CopyPlan, CopyStage
from jaxserve.kv.disk_link import DiskLink
from jaxserve.kv.disk_loads import DiskLoads
from jaxserve.kv.disk_tier import DiskTier
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.leases import Leases
from jaxserve.kv.prefix_cache import PrefixCache, PrefixHit
from jaxserve.kv.radix_cache import RadixCache
from jaxserve.kv.radix_node import CacheStats


class KVCacheManager:
    """Block tables (`KVHandle`s), admission, growth, copy-on-write, prefix reuse and swap; the
    leases (pins, holds) and the disk tier's loads through `leases` and `disk`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        watermark_blocks: int | None = None,
        enable_prefix_cache: bool = True,
        num_host_slots: int = 0,
        spill_to_host: bool = True,
        pin_budget_blocks: int | None = None,
        max_pinned_blocks: int | None = None,
        disk: DiskTier | None = None,
        disk_write_through_hits: int = 0,
    ) -> None:
        """
        watermark_blocks: free blocks that admissions and swap-ins must leave for running
            sequences to grow into (default 1% of the pool).
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
        radix = (
            RadixCache(self.pool, self.host, self.copies, spill_to_host=spill_to_host) if enable_prefix_cache else None
        )
        self.prefix_cache: PrefixCache | None = radix
        self.leases = Leases(
            self.prefix_cache,
            self.pool,
            usable // 8 if pin_budget_blocks is None else pin_budget_blocks,
            usable // 2 if max_pinned_blocks is None else max_pinned_blocks,
            self._changed,
        )
        self._handles: set[KVHandle] = set()  # the live ones (for accounting and checks)
        self._epoch = 0  # moves on every change a PrefixHit depends on
        self.disk = None
        if disk is not None:
            if radix is None:
                raise ValueError("the disk tier needs the prefix cache")
            self.disk = DiskLink(disk, radix, self.copies, write_through_hits=disk_write_through_hits)
        self.loads = DiskLoads(self.disk, lambda: self._epoch, self._changed)

    def _changed(self) -> None:
        self._epoch += 1

    # ------------------------------------------------------------------ queries

    @property
    def num_live_handles(self) -> int:
        """Sequences holding a block table (running, or swapped out)."""
        return len(self._handles)

    def live_handles(self) -> list[KVHandle]:
        return list(self._handles)

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
        return kv_usage(self)

    # ------------------------------------------------------------------ admission

    def new_chain(self) -> ChainKeys:
        """Content keys for one request's tokens, seeded as the disk tier's are (when there is
        one): pass the same chain to every `match_prefix` of that request, so its keys are
        computed once."""
        return self.disk.new_chain() if self.disk is not None else ChainKeys(bytes(KEY_BYTES), self.block_size)

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
        return PrefixHit(
            match.num_tokens,
            match.num_host_tokens,
            len(token_ids),
            match.node,
            match.device_blocks,
            match.idle_device_blocks,
            self._epoch,
            disk_tokens,
            chain,
            token_ids,
        )

    def _admit_need(self, hit: PrefixHit, num_new_tokens: int) -> int:
        if hit._epoch != self._epoch:
            raise ValueError("stale PrefixHit: the manager changed since match_prefix; match again")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        total_blocks = -(-(hit.num_tokens + num_new_tokens) // self.block_size)
        return total_blocks - len(hit._device_blocks)

    def can_admit(self, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Would `admit` succeed (leaving the watermark free for running sequences)?"""
        need = self._admit_need(hit, num_new_tokens)
        available = self.num_available_blocks - hit._idle_path_blocks
        return available - need >= self.watermark_blocks

    def admit(self, hit: PrefixHit, num_new_tokens: int, load_key: Hashable | None = None) -> KVHandle | None:
        """Start a sequence: reuse the hit's cached blocks, add slots for `num_new_tokens`. Its
        handle has `num_tokens == hit.num_tokens + num_new_tokens`. None, with nothing changed,
        when the blocks needed would eat into the watermark. `load_key`: the key the request's
        disk load was started with, whose lock the admission takes over."""
        if not self.can_admit(hit, num_new_tokens):
            return None
        need = self._admit_need(hit, num_new_tokens)
        self._epoch += 1
        cache = self.prefix_cache
        path = list(hit._device_blocks)
        node = hit._node
        if cache is not None:
            cache.lock(node)
            if self.disk is not None:
                if load_key is not None:
                    self.disk.release(load_key, hit.num_tokens)
                self.disk.count_hits(hit._chain, hit._token_ids, hit._device_blocks)
            if hit.num_host_tokens:
                path += cache.load_to_device(node)
            cache.stats.record(hit.num_prompt_tokens, hit.num_tokens - hit.num_host_tokens, hit.num_host_tokens)
        for block in path:
            self.pool.incref(block)
        new = self._allocate(need - hit.num_host_tokens // self.block_size)
        handle = KVHandle(self.block_size, path + new, hit.num_tokens + num_new_tokens, node, len(path), hit._chain)
        self._handles.add(handle)
        return handle

    def flush_to_disk(self) -> int:
        """At a clean shutdown: plan disk writes of the cached blocks the disk tier lacks, within
        its budget (see `DiskLink.flush`); run the copies, then close the tier. Returns the blocks
        planned (0 without a disk tier)."""
        return self.disk.flush() if self.disk is not None else 0

    # ------------------------------------------------------------------ growth

    def _growth_need(self, handle: KVHandle, num_new_tokens: int) -> tuple[int, bool]:
        """(blocks to allocate, whether the last block must be copied before writing)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        new_blocks = -(-(handle.num_tokens + num_new_tokens) // bs) - handle.num_blocks
        cow = (
            num_new_tokens > 0
            and handle.num_tokens % bs != 0
            and self.pool.refcount[handle.table[handle.num_blocks - 1]] > 1
        )
        return new_blocks + cow, cow

    def can_allocate(self, handle: KVHandle, num_new_tokens: int) -> bool:
        """Would `allocate_slots` succeed? (Running sequences may use the watermark reserve.)"""
        need, _ = self._growth_need(self._on_device(handle), num_new_tokens)
        return need <= self.num_available_blocks

    def allocate_slots(self, handle: KVHandle, num_new_tokens: int) -> bool:
        """Add `num_new_tokens` slots to a running sequence; False (nothing changed) if short.

        A shared, partly filled last block is copied first (copy-on-write): the copy is planned
        and shows up in `take_copies()`.
        """
        need, cow = self._growth_need(self._on_device(handle), num_new_tokens)
        self._epoch += 1
        if need == 0:
            handle.num_tokens += num_new_tokens
            return True
        if need > self.num_available_blocks:
            return False
        blocks = self._allocate(need)
        if cow:
            last = handle.num_blocks - 1
            shared = int(handle.table[last])
            copy = blocks.pop()
            self.copies.add(CopyKind.DEVICE_TO_DEVICE, shared, copy)
            self.pool.decref(shared)
            handle.table[last] = copy
            handle.renew_version()
        handle.append(blocks)
        handle.num_tokens += num_new_tokens
        return True

    def release_slots(self, handle: KVHandle, num_tokens: int) -> None:
        """Shrink a running sequence to its first `num_tokens` slots, freeing the blocks past them
        (speculative decoding: the slots of rejected draft tokens). Cached blocks are kept: they
        only ever hold computed tokens."""
        self._on_device(handle)
        bs = self.block_size
        if not handle.cached_blocks * bs <= num_tokens <= handle.num_tokens:
            raise ValueError(
                f"cannot shrink a sequence from {handle.num_tokens} to {num_tokens} slots "
                f"({handle.cached_blocks} cached blocks)"
            )
        keep = -(-num_tokens // bs)
        self._epoch += 1
        if keep < handle.num_blocks:
            self.pool.decref_all(handle.table[keep : handle.num_blocks].tolist())
            handle.num_blocks = keep
            handle.renew_version()
        handle.num_tokens = num_tokens

    def _allocate(self, n: int) -> list[int]:
        if self.prefix_cache is not None:
            return self.prefix_cache.allocate(n)
        return self.pool.allocate(n)

    # ------------------------------------------------------------------ prefix caching

    def cache_full_blocks(self, handle: KVHandle, token_ids: Sequence[int] | np.ndarray) -> int:
        """Put the sequence's newly filled blocks into the prefix cache.

        `token_ids` are the sequence's tokens from position 0 whose KV has been written (call
        after the step). Cheap when no block filled since the last call. Returns how many
        leading blocks of the sequence are now cached. A no-op without a prefix cache.
        """
        self._on_device(handle)
        cache = self.prefix_cache
        if cache is None:
            return 0
        if len(token_ids) > handle.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids but only {handle.num_tokens} slots")
        bs = self.block_size
        full = len(token_ids) // bs
        done = handle.cached_blocks
        if full <= done:
            return done
        self._epoch += 1
        table = handle.table
        result = cache.insert(token_ids[done * bs : full * bs], table[done:full].tolist(), parent=handle.node)
        cache.unlock(handle.node)
        handle.node = result.node
        pool = self.pool
        adopted = []
        for i, cached in enumerate(result.blocks, start=done):
            own = int(table[i])
            if cached != own:  # the cache had these tokens already: use its block
                pool.incref(cached)
                pool.decref(own)
                table[i] = cached
                handle.renew_version()
            elif self.disk is not None:
                adopted.append(i)
        if adopted:
            if handle.chain is None:
                handle.chain = self.disk.new_chain()
            self.disk.write_through(handle.chain, token_ids, {i: int(table[i]) for i in adopted})
        handle.cached_blocks = done + len(result.blocks)
        return handle.cached_blocks

    def clear_prefix_cache(self) -> int:
        """Drop every cached block no sequence or lease holds (both tiers); returns blocks freed."""
        if self.prefix_cache is None:
            return 0
        self._epoch += 1
        return self.prefix_cache.clear()

    # ------------------------------------------------------------------ fork, free

    def fork(self, parent: KVHandle) -> KVHandle:
        """A new sequence sharing every block of `parent` (copy-on-write on the partial one)."""
        self._on_device(parent)
        self._epoch += 1
        blocks = parent.table[: parent.num_blocks].tolist()
        for block in blocks:
            self.pool.incref(block)
        if self.prefix_cache is not None:
            self.prefix_cache.lock(parent.node)
        chain = parent.chain.fork() if parent.chain is not None else None
        child = KVHandle(
            self.block_size,
            blocks,
            parent.num_tokens,
            parent.node,
            parent.cached_blocks,
            chain,
            capacity=len(parent.table),
        )
        self._handles.add(child)
        return child

    def free(self, handle: KVHandle) -> None:
        """Release everything the sequence holds (finish, abort, or preempt-to-recompute)."""
        if not handle.is_live:
            raise ValueError("free of a KV handle that was freed already")
        self._epoch += 1
        self._handles.remove(handle)
        handle.is_live = False
        if handle.host_slots is not None:
            self.host.free(handle.host_slots)
            handle.host_slots = None
            return
        self.pool.decref_all(handle.table[: handle.num_blocks].tolist())
        handle.num_blocks = 0
        if self.prefix_cache is not None:
            self.prefix_cache.unlock(handle.node)

    # ------------------------------------------------------------------ swap

    def can_swap_out(self, handle: KVHandle) -> bool:
        n = self._on_device(handle).num_blocks
        if self.host is None:
            return False
        if self.prefix_cache is not None:
            return self.prefix_cache.can_reserve_host(n)
        return self.host.num_free >= n

    def swap_out(self, handle: KVHandle) -> bool:
        """Preempt by copying the sequence's blocks to host slots and freeing them on the device.

        Cached host blocks are evicted to make room if needed. False (nothing changed) when the
        host tier cannot take the sequence.
        """
        if not self.can_swap_out(handle):
            return False
        self._epoch += 1
        n = handle.num_blocks
        slots = self.prefix_cache.reserve_host(n) if self.prefix_cache is not None else self.host.allocate(n)
        blocks = handle.table[:n].tolist()
        for block, slot in zip(blocks, slots):
            self.copies.add(CopyKind.DEVICE_TO_HOST, block, slot)
        self.pool.decref_all(blocks)
        if self.prefix_cache is not None:
            self.prefix_cache.unlock(handle.node)
            handle.node = self.prefix_cache.root
        handle.host_slots = slots
        handle.num_blocks = 0
        handle.renew_version()
        handle.cached_blocks = 0
        return True

    def can_swap_in(self, handle: KVHandle) -> bool:
        if handle.host_slots is None:
            raise ValueError("the sequence is not swapped out")
        return self.num_available_blocks - len(handle.host_slots) >= self.watermark_blocks

    def swap_in(self, handle: KVHandle) -> bool:
        """Bring a swapped-out sequence back; False (nothing changed) if the device is too full."""
        if not self.can_swap_in(handle):
            return False
        self._epoch += 1
        slots = handle.host_slots
        blocks = self._allocate(len(slots))
        for slot, block in zip(slots, blocks):
            self.copies.add(CopyKind.HOST_TO_DEVICE, slot, block)
        self.host.free(slots)
        handle.host_slots = None
        handle.append(blocks)
        handle.renew_version()
        return True

    def take_copies(self) -> list[CopyStage]:
        """Block copies planned since the last call, as ordered stages: run them before the step."""
        return self.copies.take()

    # ------------------------------------------------------------------ imported KV

    def allocate_import(self, n: int) -> list[int]:
        """Up to `n` fresh blocks for KV read from another engine: fewer (maybe none) where more
        would eat into the watermark. Write their KV, then `leases.adopt_import` them. Evicting
        idle cached blocks for them may plan copies: run `take_copies()` before writing."""
        self._epoch += 1
        return self._allocate(max(0, min(n, self.num_available_blocks - self.watermark_blocks)))

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Check the invariants of pool, tables, cache, host tier and leases (AssertionError)."""
        check_integrity(self)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _on_device(handle: KVHandle) -> KVHandle:
        if not handle.is_live:
            raise ValueError("the sequence's KV handle was freed")
        if handle.host_slots is not None:
            raise ValueError("the sequence is swapped out; swap_in first")
        return handle
