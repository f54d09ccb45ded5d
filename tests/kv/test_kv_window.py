"""Sliding-window KV (jaxserve/kv/window.py): a sequence releases the blocks before its window as it
grows, so a long decode holds a bounded number of blocks; prefix hits, swap and free still account
every block, and the blocks in the window read back as their tokens (`kv_sim`'s fake KV)."""

from __future__ import annotations

import numpy as np
import pytest
from kv_sim import FakeEngine

from jaxserve.kv import RESERVED_BLOCK, build_kv_manager
from jaxserve.kv.window import first_needed_block

BS, WINDOW = 4, 8
MOST_HELD = WINDOW // BS + 1  # blocks of the window's keys, and the one the next token goes into


def engine(num_blocks: int = 64, **kwargs) -> FakeEngine:
    kwargs.setdefault("watermark_blocks", 0)
    return FakeEngine(build_kv_manager(num_blocks, BS, sliding_window=WINDOW, **kwargs))


def after_step(eng: FakeEngine, rid: str, prompt_len: int) -> None:
    """The engine's part after a step: run it, cache the prompt's full blocks (as the scheduler
    does for a sliding-window model), slide the window to the next query, check everything."""
    eng.run_step(cache=False)
    req = eng.reqs[rid]
    eng.mgr.cache_full_blocks(req.kv, req.tokens[: min(req.computed, prompt_len)])
    eng.mgr.window.slide(req.kv, req.computed)
    eng.check_bookkeeping()
    eng.check_content()


def run(eng: FakeEngine, rid: str, prompt: list[int], decode: int, chunk: int = 8) -> list[int]:
    """Prefill `prompt` in chunks, then decode `decode` tokens; returns the blocks held after each step."""
    held = []
    assert eng.admit(rid, prompt, chunk)
    after_step(eng, rid, len(prompt))
    while eng.reqs[rid].computed < len(prompt):
        assert eng.step(rid, chunk, 0)
        after_step(eng, rid, len(prompt))
    for i in range(decode):
        assert eng.step(rid, 1, 1000 + i)
        after_step(eng, rid, len(prompt))
        held.append(len(eng.reqs[rid].kv.held_blocks))
    return held


def test_first_needed_block_keeps_every_key_a_later_query_reads() -> None:
    for start in range(40):
        first = first_needed_block(WINDOW, BS, start)
        assert first * BS <= max(start - WINDOW + 1, 0) < (first + 1) * BS or start < WINDOW


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_long_decode_holds_only_its_window(prefix_cache: bool) -> None:
    eng = engine(enable_prefix_cache=prefix_cache)
    mgr = eng.mgr
    prompt = list(range(1, 31))
    held = run(eng, "a", prompt, decode=60)
    assert max(held) <= MOST_HELD
    kv = eng.reqs["a"].kv
    assert kv.num_dropped == kv.num_blocks - len(kv.held_blocks) >= 20
    assert (kv.block_table[: kv.num_dropped] == RESERVED_BLOCK).all()
    # The prompt's blocks stay cached (idle now: the window left them), the rest went back to the pool.
    assert kv.cached_blocks == 0 and mgr.num_available_blocks == mgr.pool.num_usable - len(kv.held_blocks)
    assert mgr.usage().cached == (len(prompt) // BS if prefix_cache else 0)
    eng.drain()


def test_the_prompt_stays_cached_while_its_last_block_is_in_the_window() -> None:
    eng = engine()
    mgr = eng.mgr
    prompt = list(range(1, 21))  # 5 full blocks
    held = run(eng, "a", prompt, decode=3)
    kv = eng.reqs["a"].kv
    assert kv.cached_blocks == 5 and kv.num_dropped > 0 and max(held) <= MOST_HELD
    assert mgr.prefix_cache.num_evictable_blocks == 0  # locked: the sequence holds its last block
    assert mgr.usage().used == kv.num_dropped + len(kv.held_blocks)  # the dropped ones locked, so in use
    run_more = [eng.step("a", 1, 7) for _ in range(WINDOW)]
    assert all(run_more)
    after_step(eng, "a", len(prompt))
    assert kv.cached_blocks == 0 and mgr.prefix_cache.num_evictable_blocks == 5
    eng.drain()


def test_a_prefix_hit_drops_the_hit_blocks_before_the_window() -> None:
    eng = engine()
    prompt = list(range(1, 41))
    run(eng, "a", prompt, decode=2)
    eng.finish("a")
    shared = prompt[:36] + [90, 91, 92, 93, 94, 95]
    hit = eng.mgr.match_prefix(shared)
    assert hit.num_tokens == 36
    run(eng, "b", shared, decode=20)
    kv = eng.reqs["b"].kv
    assert kv.num_dropped > 0 and len(kv.held_blocks) <= MOST_HELD
    eng.drain()


def test_swap_out_and_in_moves_only_the_window() -> None:
    eng = engine(num_host_slots=16)
    mgr = eng.mgr
    run(eng, "a", list(range(1, 25)), decode=12)
    kv = eng.reqs["a"].kv
    held, dropped = len(kv.held_blocks), kv.num_dropped
    assert eng.swap_out("a")
    eng.check_bookkeeping()
    assert len(kv.host_slots) == held and mgr.host.num_free == 16 - held
    eng.execute_copies()
    assert eng.swap_in("a")
    eng.run_step(cache=False)
    eng.check_bookkeeping()
    eng.check_content()
    assert kv.num_dropped == dropped and (kv.block_table[:dropped] == RESERVED_BLOCK).all()
    for i in range(8):
        assert eng.step("a", 1, 500 + i)
        after_step(eng, "a", 24)
    eng.drain()


def test_recompute_preemption_frees_every_held_block() -> None:
    eng = engine()
    run(eng, "a", list(range(1, 25)), decode=12)
    eng.preempt("a")
    eng.check_bookkeeping()
    tokens = eng.waiting.pop("a")
    held = run(eng, "a", tokens, decode=4, chunk=16)  # its prompt's blocks hit; the rest recomputed
    assert max(held) <= MOST_HELD
    eng.drain()


def test_a_window_is_refused_with_state_slots() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        build_kv_manager(16, BS, sliding_window=WINDOW, num_state_slots=3)
    with pytest.raises(ValueError, match="sliding_window"):
        build_kv_manager(16, BS, sliding_window=0)


def test_without_a_window_nothing_is_dropped() -> None:
    eng = FakeEngine(build_kv_manager(64, BS, watermark_blocks=0))
    held = run(eng, "a", list(range(1, 21)), decode=20)
    assert held == [-(-(20 + i) // BS) for i in range(1, 21)] and eng.reqs["a"].kv.num_dropped == 0
    assert np.all(eng.reqs["a"].kv.block_table != RESERVED_BLOCK)
    eng.drain()
