"""Radix prefix cache edge cases: splits, dedupe, adoption rule, LRU eviction, host spill."""

from __future__ import annotations

import pytest

from jaxserve.kv import (
    BlockPool,
    CopyKind,
    HostTier,
    NoFreeBlocksError,
    NoPrefixCache,
    PrefixCache,
    RadixCache,
    SpillingPrefixCache,
    build_kv_manager,
)

BS = 4


def seq(*values: int) -> list[int]:
    """One block per value: block i holds [v, v, v, v]."""
    return [v for v in values for _ in range(BS)]


def cached(cache: RadixCache, tokens: list[int], blocks: list[int] | None = None) -> list[int]:
    """Insert fresh blocks for `tokens` (as a request would after its step) and release them."""
    pool = cache.pool
    if blocks is None:
        blocks = pool.allocate(len(tokens) // BS)
    result = cache.insert(tokens, blocks)
    cache.unlock(result.path)
    pool.decref_all(blocks)  # the request finishes; the tree keeps what it adopted
    return result.blocks


def test_the_manager_reaches_the_cache_through_its_interface() -> None:
    assert isinstance(RadixCache(BlockPool(8, BS)), PrefixCache)
    assert isinstance(RadixCache(BlockPool(8, BS)), SpillingPrefixCache)
    assert isinstance(build_kv_manager(8, BS).prefix_cache, PrefixCache)
    off = build_kv_manager(8, BS, enable_prefix_cache=False).prefix_cache
    assert isinstance(off, NoPrefixCache) and isinstance(off, PrefixCache)


def test_match_ending_mid_node_splits_it() -> None:
    cache = RadixCache(BlockPool(32, BS))
    blocks = cached(cache, seq(1, 2, 3, 4))
    assert len(list(cache.nodes())) == 1
    match = cache.match(seq(1, 2, 9), leave_last_token=False)
    assert match.device_blocks == blocks[:2] and match.num_tokens == 2 * BS
    assert len(list(cache.nodes())) == 2  # [1,2] -> [3,4]
    assert match.path.end == 2
    cache.lock(match.path)  # only the matched part is protected
    assert cache.num_evictable_blocks == 2
    assert cache.evict(10) == 2
    assert cache.match(seq(1, 2, 3, 4), leave_last_token=False).device_blocks == blocks[:2]
    cache.unlock(match.path)
    cache.check_integrity({})


def test_split_by_a_match_that_is_not_used_keeps_lru_order() -> None:
    cache = RadixCache(BlockPool(32, BS))
    cached(cache, seq(1, 2))
    blocks = cached(cache, seq(1, 2, 3, 4))  # [1, 2] -> [3, 4], both idle
    assert cache.match(seq(1, 2, 3, 9), leave_last_token=False).num_blocks == 3
    cache.check_integrity({})  # [1, 2] -> [3] -> [4], nothing locked
    assert cache.evict(1) == 1  # leaves go first: [4]
    assert cache.match(seq(1, 2, 3, 4), leave_last_token=False).device_blocks == blocks[:3]
    assert cache.evict(1) == 1  # then [3], never [2] before it
    assert cache.match(seq(1, 2, 3, 4), leave_last_token=False).device_blocks == blocks[:2]
    cache.check_integrity({})


def test_match_leaves_the_last_prompt_token() -> None:
    cache = RadixCache(BlockPool(32, BS))
    cached(cache, seq(1, 2, 3))
    assert cache.match(seq(1, 2, 3)).num_blocks == 2  # 12 tokens: at most 11 may match
    assert cache.match(seq(1, 2, 3) + [0]).num_blocks == 3
    assert cache.match(seq(1, 2, 3), leave_last_token=False).num_blocks == 3
    assert cache.match([]).num_blocks == 0
    assert cache.match(seq(1)[:3]).num_blocks == 0  # partial blocks never match


def test_insert_keeps_existing_blocks_and_adopts_new_ones() -> None:
    pool = BlockPool(32, BS)
    cache = RadixCache(pool)
    first = cached(cache, seq(1, 2))
    mine = pool.allocate(3)
    result = cache.insert(seq(1, 2, 5), mine)
    assert result.blocks == first + [mine[2]]  # positions 0-1 are the tree's, 2 adopted
    assert pool.refcount[mine[2]] == 2  # caller + tree
    assert result.path.lock == 1
    cache.check_integrity({result.path: 1})
    cache.unlock(result.path)
    pool.decref_all(mine)
    assert [pool.refcount[b] for b in mine] == [0, 0, 1]
    cache.check_integrity({})


def test_insert_does_not_adopt_a_block_someone_else_holds() -> None:
    pool = BlockPool(32, BS)
    cache = RadixCache(pool)
    mine = pool.allocate(2)
    pool.incref(mine[1])  # shared with a fork sibling
    result = cache.insert(seq(1, 2), mine)
    assert result.blocks == mine[:1]  # stops before the shared block
    assert result.path.end == 1
    pool.decref(mine[1])  # the sibling is gone: now it can be cached
    parent = result.path  # still locked by this caller
    result = cache.insert(seq(2), mine[1:], parent=parent)
    cache.unlock(parent)
    assert result.path.end == 2 and result.blocks == mine[1:]
    cache.check_integrity({result.path: 1})
    cache.unlock(result.path)
    pool.decref_all(mine)
    cache.check_integrity({})


def test_long_conversation_grows_one_node_in_place() -> None:
    pool = BlockPool(64, BS)
    cache = RadixCache(pool)
    blocks = pool.allocate(1)
    node = cache.insert(seq(1), blocks).path
    for turn in range(2, 30):
        new = pool.allocate(1)
        blocks += new
        result = cache.insert(seq(turn), new, parent=node)
        cache.unlock(node)
        node = result.path
    assert len(list(cache.nodes())) == 1 and node.length == 29
    cache.check_integrity({node: 1})
    cache.unlock(node)
    pool.decref_all(blocks)


def test_eviction_is_lru_and_takes_the_tail_of_the_oldest_leaf() -> None:
    cache = RadixCache(BlockPool(32, BS))
    old = cached(cache, seq(1, 2, 3))
    new = cached(cache, seq(7, 8))
    assert cache.evict(2) == 2  # the tail [2, 3] of the older branch goes
    assert cache.match(seq(1, 2, 3), leave_last_token=False).device_blocks == old[:1]
    assert cache.match(seq(7, 8), leave_last_token=False).device_blocks == new
    touched = cache.match(seq(1, 9), leave_last_token=False).path
    cache.lock(touched)  # a use makes [1] the most recent
    cache.unlock(touched)
    assert cache.evict(1) == 1
    assert cache.match(seq(7, 8), leave_last_token=False).num_blocks == 1
    assert cache.match(seq(1), leave_last_token=False).num_blocks == 1
    cache.check_integrity({})


def test_eviction_under_pressure_never_touches_locked_paths() -> None:
    pool = BlockPool(9, BS)  # 8 usable blocks
    cache = RadixCache(pool)
    cached(cache, seq(1, 2, 3))
    cached(cache, seq(1, 2, 5))  # shares [1, 2]
    cached(cache, seq(6, 6))
    locked = cache.match(seq(1, 2, 5), leave_last_token=False).path
    cache.lock(locked)  # [1, 2, 5] in use by a request
    assert pool.num_free == 2 and cache.num_evictable_blocks == 3
    taken = cache.allocate(5)  # frees every idle block, nothing locked
    assert cache.match(seq(1, 2, 5), leave_last_token=False).num_blocks == 3
    assert cache.match(seq(1, 2, 3), leave_last_token=False).num_blocks == 2
    with pytest.raises(NoFreeBlocksError):
        cache.allocate(1)
    cache.check_integrity({locked: 1})
    cache.unlock(locked)
    pool.decref_all(taken)
    assert cache.clear() == 3 and pool.num_free == 8


def test_spill_to_host_and_reload_instead_of_recompute() -> None:
    pool, host = BlockPool(9, BS), HostTier(4)
    cache = RadixCache(pool, host)
    blocks = cached(cache, seq(1, 2, 3))
    assert cache.evict(2) == 2  # [2, 3] spill to the host
    stages = cache.copies.take()
    assert [(s.kind, s.src) for s in stages] == [(CopyKind.DEVICE_TO_HOST, blocks[1:])]
    spilled_host_slots = stages[0].dst
    match = cache.match(seq(1, 2, 3, 4))
    assert match.device_blocks == blocks[:1] and match.num_host_blocks == 2
    cache.lock(match.path)
    loaded = cache.load_to_device(match.path)
    (stage,) = cache.copies.take()
    assert stage.kind is CopyKind.HOST_TO_DEVICE
    assert stage.pairs == list(zip(spilled_host_slots, loaded))
    assert cache.match(seq(1, 2, 3, 4)).device_blocks == blocks[:1] + loaded
    assert host.num_free == 4
    cache.check_integrity({match.path: 1})
    cache.unlock(match.path)


def test_spill_makes_room_by_dropping_old_host_blocks_and_drops_when_host_is_locked() -> None:
    pool, host = BlockPool(9, BS), HostTier(2)
    cache = RadixCache(pool, host)
    cached(cache, seq(1, 1))
    cached(cache, seq(2, 2))
    cache.evict(2)  # [1, 1] to the host (older)
    cache.evict(2)  # [2, 2] to the host, dropping [1, 1]
    assert cache.match(seq(1, 1), leave_last_token=False).num_blocks == 0
    assert cache.match(seq(2, 2), leave_last_token=False).num_host_blocks == 2
    pinned = cache.match(seq(2, 2), leave_last_token=False).path
    cache.lock(pinned)  # host copy pinned: no room left to spill
    cached(cache, seq(3))
    cache.evict(1)
    assert cache.match(seq(3), leave_last_token=False).num_blocks == 0  # dropped
    cache.check_integrity({pinned: 1})
    cache.unlock(pinned)
    cache.copies.take()


def test_dropping_a_device_leaf_drops_its_spilled_descendants() -> None:
    pool, host = BlockPool(9, BS), HostTier(1)
    cache = RadixCache(pool, host)
    cached(cache, seq(1, 1, 1, 2))
    cache.evict(1)  # [2] to the host, which is now full
    assert cache.num_host_blocks == 1
    assert cache.evict(3) == 3  # [1, 1, 1] cannot spill: dropped with [2]
    assert cache.num_host_blocks == 0 and host.num_free == 1
    assert cache.match(seq(1, 1, 1, 2), leave_last_token=False).num_blocks == 0
    cache.check_integrity({})
    cache.copies.take()


def test_insert_over_a_spilled_path_takes_the_fresh_device_blocks() -> None:
    pool, host = BlockPool(9, BS), HostTier(4)
    cache = RadixCache(pool, host)
    cached(cache, seq(1, 2))
    cache.evict(2)
    assert cache.num_host_blocks == 2
    mine = pool.allocate(3)
    result = cache.insert(seq(1, 2, 3), mine)  # recomputed while the cache had it on host
    assert result.blocks == mine and cache.num_host_blocks == 0 and host.num_free == 4
    cache.check_integrity({result.path: 1})
    cache.unlock(result.path)
    pool.decref_all(mine)


def test_insert_over_a_spilled_path_leaves_it_on_the_host_if_the_blocks_are_shared() -> None:
    pool, host = BlockPool(9, BS), HostTier(4)
    cache = RadixCache(pool, host)
    cached(cache, seq(1, 2))
    cache.evict(2)
    mine = pool.allocate(2)
    pool.incref(mine[1])  # a fork sibling holds the second block
    result = cache.insert(seq(1, 2), mine)
    assert result.blocks == mine[:1] and cache.num_host_blocks == 1
    cache.check_integrity({result.path: 1})
    cache.unlock(result.path)
    pool.decref_all(mine + mine[1:])
    cache.check_integrity({})


def test_unlock_without_lock_is_an_error() -> None:
    cache = RadixCache(BlockPool(9, BS))
    cached(cache, seq(1))
    node = cache.match(seq(1), leave_last_token=False).path
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)


def test_thousands_of_sessions_share_one_system_prompt() -> None:
    pool = BlockPool(20_000, BS)
    cache = RadixCache(pool)
    system = seq(*range(100, 108))  # 8 blocks
    nodes, held = [], []
    for session in range(3000):
        tokens = system + seq(1000 + session, 2000 + session % 7)
        match = cache.match(tokens + [0])
        cache.lock(match.path)
        fresh = pool.allocate(10 - match.num_blocks)
        result = cache.insert(tokens[match.num_tokens :], fresh, parent=match.path)
        cache.unlock(match.path)
        nodes.append(result.path)
        held.append(fresh)
    assert cache.num_device_blocks == 8 + 3000 * 2
    assert cache.match(system + [0]).path.lock == 3000
    cache.check_integrity({node: 1 for node in nodes})
    for node, fresh in zip(nodes, held):
        cache.unlock(node)
        pool.decref_all(fresh)
    assert cache.num_evictable_blocks == cache.num_device_blocks
    assert cache.clear() == 8 + 3000 * 2
    cache.check_integrity({})
