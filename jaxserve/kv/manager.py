"""KV cache manager: sequences' block tables over one block pool, prefix cache and tiers.

Plain Python + numpy; the engine thread is its only user (not thread safe). A sequence's block
table is a `KVHandle` (`block_table.py`) that its request owns; the manager makes handles and
edits the handle it is given. How the scheduler uses it, every step:

    hit = mgr.match_prefix(prompt_ids, chain)  # cached prefix; valid until the next change
    req.kv = mgr.admit(hit, n)                 # None: it would eat into the watermark
    ok = mgr.allocate_kv_slots(req.kv, n)         # grow (decode: 1, a chunk: n); False: preempt, retry
    stages = mgr.take_copies()                 # swap, spill and reload copies, before the step
    mgr.cache_full_blocks(req.kv, token_ids)   # after the step: filled blocks join the prefix cache

Preempt with `free(handle)` (recompute: admit again later, the cached blocks will hit) or
`swap_out(handle)`, resumed by `swap_in(handle)`. A handle's `version` changes when entries of its
table are replaced (not when blocks are appended), so a copy of a table with the same version and
length is current. Running sequences may grow into the watermark reserve; admissions and swap-ins
may not. `can_admit`, `can_swap_in/out` peek.

The manager is given its prefix cache (`prefix_cache.PrefixCache`: the radix cache, or one that
caches nothing when prefix caching is off) and its link to a tier below the host tier
(`tier_link.TierLink`, or `no_tier_link.NoTierLink` without one); `build.build_kv_manager` builds
them all.

Sessions and KV handed between workers keep cached blocks through `leases` (`leases.py`).
With a lower tier (the disk tier), `match_prefix` also reports the blocks after the cache's match
that the tier holds; the scheduler may `loads.start(key, hit)` them into the host tier instead of
admitting, then admit once `loads.poll()` has put them in the cache (`tier_loads.py`). Cached
blocks are written to the tier as the copy plan's `*_TO_DISK` stages (`tier_link.py`).

With `sliding_window` (a model whose every attention layer slides), `window.slide(handle, start)`
releases the blocks no query from `start` on reads (`window.py`).

Design notes. A sequence locks the prefix-cache path of its cached leading blocks
(`cached_blocks`), so a block it holds is never evicted under it. Swap-out copies every block the
table holds to the host (shared prefix blocks too: the sequence comes back whole whatever the cache
did meanwhile). Token ids must fit in int32 (the cache keys tokens as int32 bytes).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from jaxserve.kv.accounting import KVUsage, check_integrity, kv_usage
from jaxserve.kv.block_pool import RESERVED_BLOCK, BlockPool
from jaxserve.kv.block_table import KVHandle
from jaxserve.kv.content_keys import ChainKeys
from jaxserve.kv.copy_plan import CopyKind, CopyPlan, CopyStage
from jaxserve.kv.host_tier import HostTier
from jaxserve.kv.kv_events import KVEventLog
from jaxserve.kv.leases import Leases
from jaxserve.kv.prefix_cache import CacheStats, PrefixCache
from jaxserve.kv.prefix_hit import PrefixHit
from jaxserve.kv.state_slots import StateSlots
from jaxserve.kv.state_snapshots import StateSnapshots, cut_to_snapshot
from jaxserve.kv.tier_link import LowerTierLink
from jaxserve.kv.tier_loads import TierLoads
from jaxserve.kv.window import SlidingWindow


class KVCacheManager:
    """Block tables (`KVHandle`s), admission, growth, prefix reuse and swap; the leases (pins,
    holds) and the lower tier's loads through `leases` and `loads`."""

    def __init__(
        self,
        pool: BlockPool,
        prefix_cache: PrefixCache,
        host: HostTier,
        copies: CopyPlan,
        *,
        watermark_blocks: int = 0,
        pin_budget_blocks: int | None = None,
        max_pinned_blocks: int | None = None,
        tier_link: LowerTierLink,
        events: KVEventLog | None = None,
        state_slots: StateSlots | None = None,
        num_snapshots: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        """
        prefix_cache, host, copies: the prefix cache over `pool`, the host tier and the copy plan
            they plan into (see `build.build_kv_manager`).
        watermark_blocks: free blocks that admissions and swap-ins must leave for running
            sequences to grow into (an engine's: `ResolvedConfig.watermark_blocks`, 1% of the pool
            unless asked, chosen by config resolution).
        pin_budget_blocks: most blocks one owner may pin (default 1/8 of the pool).
        max_pinned_blocks: most blocks all pins together may pin (default half the pool).
        tier_link: the link of the prefix cache to a tier below the host tier (the disk tier), or
            `NoTierLink` when there is none.
        events: where the prefix cache's changes are recorded for a router (`kv_events`), or None.
        state_slots: a hybrid model's per-sequence state slots (`state_slots.py`): every admitted
            sequence holds one until it is freed; None: none (a model of attention layers only).
        num_snapshots: a hybrid's state snapshots kept for prefix hits, at most (`state_snapshots.py`).
        sliding_window: the window of a model whose every attention layer slides: `window.slide`
            releases the blocks before it (`window.py`); None: sequences keep every block.
        """
        self.pool = pool
        self.block_size = pool.block_size
        usable = pool.num_usable
        self.watermark_blocks = watermark_blocks
        if not 0 <= watermark_blocks < usable:
            raise ValueError(f"watermark_blocks must be in [0, {usable}), got {watermark_blocks}")
        self.copies = copies
        self.host = host
        self.prefix_cache = prefix_cache
        self.leases = Leases(
            prefix_cache,
            pool,
            usable // 8 if pin_budget_blocks is None else pin_budget_blocks,
            usable // 2 if max_pinned_blocks is None else max_pinned_blocks,
            self._changed,
        )
        self._handles: set[KVHandle] = set()  # the live ones (for accounting and checks)
        self._epoch = 0  # moves on every change a PrefixHit depends on
        self.tier_link = tier_link
        self.loads = TierLoads(tier_link, lambda: self._epoch, self._changed)
        self.events = events
        self.state_slots = state_slots or StateSlots(0)
        self.snapshots = StateSnapshots(self.state_slots, num_snapshots, copies, self._changed)
        if sliding_window is not None and self.state_slots.enabled:
            raise ValueError("a sliding_window does not go with state slots (a hybrid keeps every block)")
        self.window = SlidingWindow(sliding_window, pool, prefix_cache, self._changed)

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
        return self.prefix_cache.stats

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus idle cached blocks that eviction would free."""
        return self.pool.num_free + self.prefix_cache.num_evictable_blocks

    def usage(self) -> KVUsage:
        """Counts for metrics; O(blocks), so call it per scrape, not per step."""
        return kv_usage(self)

    # ------------------------------------------------------------------ admission

    def new_chain(self) -> ChainKeys:
        """Content keys for one request's tokens, seeded as the lower tier's are (when there is
        one): pass the same chain to every `match_prefix` of that request, so its keys are
        computed once."""
        return self.tier_link.new_chain()

    def match_prefix(self, token_ids: Sequence[int] | np.ndarray, chain: ChainKeys | None = None) -> PrefixHit:
        """Find the cached prefix of a prompt. Changes nothing a hit depends on."""
        match = self.prefix_cache.match(token_ids)
        link = self.tier_link
        chain = chain if chain is not None else link.new_chain()
        if self.state_slots.enabled:  # a hybrid resumes only where a snapshot of its state is
            match = cut_to_snapshot(self.snapshots, self.prefix_cache, match, token_ids, chain)
        limit = (len(token_ids) - 1) // self.block_size
        tier_tokens = link.blocks_stored(token_ids, chain, match.num_blocks, limit) * self.block_size
        return PrefixHit(match, len(token_ids), self._epoch, chain, token_ids, tier_tokens)

    def _admit_need(self, hit: PrefixHit, num_new_tokens: int) -> int:
        if hit.epoch != self._epoch:
            raise ValueError("stale PrefixHit: the manager changed since match_prefix; match again")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        total_blocks = -(-(hit.num_tokens + num_new_tokens) // self.block_size)
        return total_blocks - len(hit.device_blocks)

    def can_admit(self, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Would `admit` succeed (leaving the watermark free for running sequences)?"""
        need = self._admit_need(hit, num_new_tokens)
        available = self.num_available_blocks - hit.match.idle_device_blocks
        no_slot = self.state_slots.enabled and not self.state_slots.num_free and not self.snapshots.num_held
        return available - need >= self.watermark_blocks and not no_slot

    def admit(self, hit: PrefixHit, num_new_tokens: int, load_key: Hashable | None = None) -> KVHandle | None:
        """Start a sequence: reuse the hit's cached blocks, add KV slots for `num_new_tokens`. Its
        handle has `num_tokens == hit.num_tokens + num_new_tokens`. None, with nothing changed,
        when the blocks needed would eat into the watermark. `load_key`: the key the request's
        lower-tier load was started with, whose lock the admission takes over."""
        if not self.can_admit(hit, num_new_tokens):
            return None
        need = self._admit_need(hit, num_new_tokens)
        self._epoch += 1
        cache = self.prefix_cache
        cache.lock(hit.path)
        if load_key is not None:
            self.tier_link.release(load_key, hit.num_tokens)
        self.tier_link.count_hits(hit.chain, hit.token_ids, hit.device_blocks)
        path = list(hit.device_blocks)
        if hit.num_host_tokens:
            path += cache.load_to_device(hit.path)
        cache.stats.record(hit.num_prompt_tokens, hit.num_tokens - hit.num_host_tokens, hit.num_host_tokens)
        for block in path:
            self.pool.incref(block)
        new = cache.allocate(need - hit.num_host_tokens // self.block_size)
        handle = KVHandle(self.block_size, path + new, hit.num_tokens + num_new_tokens, hit.path, len(path), hit.chain)
        if self.state_slots.enabled:
            self.snapshots.take_slot(handle, hit)
        self._handles.add(handle)
        return handle

    def flush_to_disk(self) -> int:
        """At a clean shutdown: plan writes of the cached blocks the lower tier lacks, within its
        budget (see `TierLink.flush`); run the copies, then close the tier. Returns the blocks
        planned (0 without a lower tier)."""
        return self.tier_link.flush()

    # ------------------------------------------------------------------ growth

    def allocate_kv_slots(self, handle: KVHandle, num_new_tokens: int) -> bool:
        """Add `num_new_tokens` KV slots to a running sequence; False (nothing changed) if short."""
        self._on_device(handle)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = -(-(handle.num_tokens + num_new_tokens) // self.block_size) - handle.num_blocks
        self._epoch += 1
        if need > 0:
            if need > self.num_available_blocks:
                return False
            handle.append(self.prefix_cache.allocate(need))
        handle.num_tokens += num_new_tokens
        return True

    def release_kv_slots(self, handle: KVHandle, num_tokens: int) -> None:
        """Shrink a running sequence to its first `num_tokens` KV slots, freeing the blocks past them
        (speculative decoding: the KV slots of rejected draft tokens). Cached blocks are kept: they
        only ever hold computed tokens."""
        self._on_device(handle)
        bs = self.block_size
        if not handle.cached_blocks * bs <= num_tokens <= handle.num_tokens:
            raise ValueError(
                f"cannot shrink a sequence from {handle.num_tokens} to {num_tokens} KV slots "
                f"({handle.cached_blocks} cached blocks)"
            )
        keep = -(-num_tokens // bs)
        self._epoch += 1
        if keep < handle.num_blocks:
            self.pool.decref_all(handle.table[keep : handle.num_blocks].tolist())
            handle.num_blocks = keep
            handle.renew_version()
        handle.num_tokens = num_tokens

    # ------------------------------------------------------------------ prefix caching

    def cache_full_blocks(self, handle: KVHandle, token_ids: Sequence[int] | np.ndarray) -> int:
        """Put the sequence's newly filled blocks into the prefix cache.

        `token_ids` are the sequence's tokens from position 0 whose KV has been written (call
        after the step). Cheap when no block filled since the last call. Returns how many
        leading blocks of the sequence are now cached (none with prefix caching off).
        """
        self._on_device(handle)
        if len(token_ids) > handle.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids but only {handle.num_tokens} KV slots")
        bs = self.block_size
        full = len(token_ids) // bs
        done = handle.cached_blocks
        if full <= done or not handle.may_cache_more:
            return done
        cache, table = self.prefix_cache, handle.table
        result = cache.insert(token_ids[done * bs : full * bs], table[done:full].tolist(), parent=handle.path)
        cache.unlock(handle.path)
        handle.path = result.path
        if not result.blocks:  # nothing kept (prefix caching off): no hit made earlier goes stale
            return done
        self._epoch += 1
        adopted = {}
        for i, cached in enumerate(result.blocks, start=done):
            own = int(table[i])
            if cached != own:  # the cache had these tokens already: use its block
                self.pool.incref(cached)
                self.pool.decref(own)
                table[i] = cached
                handle.renew_version()
            else:
                adopted[i] = own
        if adopted:
            if handle.chain is None:
                handle.chain = self.tier_link.new_chain()
            self.tier_link.seeds.note(handle.chain, token_ids)
            self.tier_link.write_through(handle.chain, token_ids, adopted)
            if self.events is not None:
                self.events.stored(handle.chain.keys(token_ids, max(adopted) + 1)[min(adopted) :])
        handle.cached_blocks = done + len(result.blocks)
        return handle.cached_blocks

    # ------------------------------------------------------------------ free

    def free(self, handle: KVHandle) -> None:
        """Release everything the sequence holds (finish, abort, or preempt-to-recompute)."""
        if not handle.is_live:
            raise ValueError("free of a KV handle that was freed already")
        self._epoch += 1
        self._handles.remove(handle)
        handle.is_live = False
        if handle.state_slot is not None:
            self.state_slots.free(handle.state_slot)
            handle.state_slot = None
        if handle.host_slots is not None:
            self.host.free(handle.host_slots)
            handle.host_slots = None
            return
        self.pool.decref_all(handle.held_blocks.tolist())
        handle.num_blocks = handle.num_dropped = 0
        self.prefix_cache.unlock(handle.path)

    # ------------------------------------------------------------------ swap

    def can_swap_out(self, handle: KVHandle) -> bool:
        return self.prefix_cache.can_reserve_host(len(self._on_device(handle).held_blocks))

    def swap_out(self, handle: KVHandle) -> bool:
        """Preempt by copying the sequence's blocks to host slots and freeing them on the device.

        Cached host blocks are evicted to make room if needed. False (nothing changed) when the
        host tier cannot take the sequence.
        """
        if not self.can_swap_out(handle):
            return False
        self._epoch += 1
        blocks = handle.held_blocks.tolist()  # the dropped ones stay dropped (`swap_in`)
        cache = self.prefix_cache
        host_slots = cache.reserve_host(len(blocks))
        for block, host_slot in zip(blocks, host_slots):
            self.copies.add(CopyKind.DEVICE_TO_HOST, block, host_slot)
        self.pool.decref_all(blocks)
        cache.unlock(handle.path)
        handle.path = cache.root
        handle.host_slots = host_slots
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
        host_slots = handle.host_slots
        blocks = self.prefix_cache.allocate(len(host_slots))
        for host_slot, block in zip(host_slots, blocks):
            self.copies.add(CopyKind.HOST_TO_DEVICE, host_slot, block)
        self.host.free(host_slots)
        handle.host_slots = None
        handle.append([RESERVED_BLOCK] * handle.num_dropped + blocks)
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
        return self.prefix_cache.allocate(max(0, min(n, self.num_available_blocks - self.watermark_blocks)))

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Check the invariants of pool, tables, cache, host tier and leases (AssertionError)."""
        check_integrity(self)

    @staticmethod
    def _on_device(handle: KVHandle) -> KVHandle:
        if not handle.is_live:
            raise ValueError("the sequence's KV handle was freed")
        if handle.host_slots is not None:
            raise ValueError("the sequence is swapped out; swap_in first")
        return handle
