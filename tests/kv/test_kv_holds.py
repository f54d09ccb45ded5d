"""Holds: the KV manager's side of handing a prompt's blocks from a prefill to a decode engine."""

from __future__ import annotations

import pytest

from jaxserve.kv import KVCacheManager, build_kv_manager

BS = 4


def _cached(mgr: KVCacheManager, tokens: list[int], check: bool = True) -> None:
    """Run a request over `tokens` (its KV written) and finish it: its full blocks stay cached."""
    hit = mgr.match_prefix(tokens)
    handle = mgr.admit(hit, len(tokens) - hit.num_tokens)
    mgr.cache_full_blocks(handle, tokens)
    mgr.free(handle)
    if check:  # (not while imported blocks are out: they are nobody's until adopted)
        mgr.check_integrity()


def _all_free(mgr: KVCacheManager) -> bool:
    u = mgr.usage()
    return u.used == 0 and u.pinned == 0 and u.free + u.cached_idle == u.num_blocks


def test_a_hold_keeps_the_prompt_blocks_until_released() -> None:
    mgr = build_kv_manager(8, BS, watermark_blocks=0)
    prompt = list(range(1, 11))  # 2 full blocks and 2 tokens
    _cached(mgr, prompt)
    hold = mgr.leases.hold_prefix(prompt)
    assert hold.num_blocks == 2 and hold.blocks == mgr.match_prefix(prompt + [0]).device_blocks[:2]
    assert mgr.usage().pinned == 2 and mgr.num_available_blocks == 5
    mgr.check_integrity()
    other = list(range(50, 70))  # needs 5 blocks: evicts all but the held ones
    hit = mgr.match_prefix(other)
    b = mgr.admit(hit, 20)
    assert b is not None and not mgr.can_admit(mgr.match_prefix([7] * 8), 8)
    assert mgr.usage().pinned == 2
    mgr.check_integrity()
    mgr.free(b)
    mgr.leases.release_hold(hold)
    with pytest.raises(ValueError):
        mgr.leases.release_hold(hold)
    mgr.check_integrity()


def test_imported_blocks_join_the_cache_after_what_was_held() -> None:
    mgr = build_kv_manager(16, BS, watermark_blocks=0)
    prompt = list(range(1, 15))  # 3 full blocks
    _cached(mgr, prompt[:4] + [99] * 4)  # the first block is cached already
    hold = mgr.leases.hold_prefix(prompt)
    assert hold.num_blocks == 1
    blocks = mgr.allocate_import(2)
    assert len(blocks) == 2
    hold = mgr.leases.adopt_import(hold, prompt, blocks)
    assert hold.num_blocks == 3 and hold.blocks[1:] == blocks
    mgr.check_integrity()
    hit = mgr.match_prefix(prompt + [7])
    assert hit.num_tokens == 12
    new = mgr.admit(hit, 3)  # admitted while held: then let go
    assert new is not None
    mgr.leases.release_hold(hold)
    mgr.check_integrity()
    mgr.free(new)
    assert _all_free(mgr)
    mgr.check_integrity()


def test_an_import_of_tokens_cached_meanwhile_gives_its_blocks_back() -> None:
    mgr = build_kv_manager(16, BS, watermark_blocks=0)
    prompt = list(range(1, 10))
    hold = mgr.leases.hold_prefix(prompt)
    assert hold.num_blocks == 0
    blocks = mgr.allocate_import(2)
    _cached(mgr, prompt, check=False)  # computed here while the bytes were on the way
    free_before = mgr.pool.num_free
    hold = mgr.leases.adopt_import(hold, prompt, blocks)
    assert hold.num_blocks == 2 and not set(hold.blocks) & set(blocks)
    assert mgr.pool.num_free == free_before + 2
    mgr.leases.release_hold(hold)
    assert _all_free(mgr)
    mgr.check_integrity()


def test_imports_leave_the_watermark_free() -> None:
    mgr = build_kv_manager(10, BS, watermark_blocks=3)  # 9 usable
    prompt = list(range(1, 41))
    hold = mgr.leases.hold_prefix(prompt)
    blocks = mgr.allocate_import(10)
    assert len(blocks) == 6
    hold = mgr.leases.adopt_import(hold, prompt, blocks)
    assert mgr.usage().pinned == 6 and mgr.allocate_import(1) == []
    mgr.leases.release_hold(hold)
    assert _all_free(mgr)
    mgr.check_integrity()


def test_without_prefix_caching_a_hold_is_empty_and_an_import_is_refused() -> None:
    mgr = build_kv_manager(16, BS, watermark_blocks=0, enable_prefix_cache=False)
    prompt = list(range(1, 10))
    _cached(mgr, prompt)  # nothing stays cached
    hold = mgr.leases.hold_prefix(prompt)
    assert hold.num_blocks == 0 and mgr.usage().pinned == 0
    blocks = mgr.allocate_import(2)
    with pytest.raises(ValueError, match="prefix cache"):
        mgr.leases.adopt_import(hold, prompt, blocks)
    assert [mgr.pool.refcount[b] for b in blocks] == [1, 1]  # still the caller's to give back
    mgr.pool.decref_all(blocks)
    mgr.leases.release_hold(hold)
    assert _all_free(mgr)
    mgr.check_integrity()
