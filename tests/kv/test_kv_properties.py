"""Property tests: random admit / step / preempt / swap / finish / pin / evict workloads.

A workload is a list of engine rounds; a round is a few manager calls followed by the step (the
planned copies run, then the scheduled tokens are written, then full blocks are cached).
After every call: the manager's invariants plus an independent recount of holders against the
refcounts (free xor referenced, block 0 never handed out, tables cover their tokens) and pinned
paths still cached. After every step: every request's blocks read back as its tokens and every
cached block holds its key. At the end everything is free again.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_sim import FakeEngine

from jaxserve.kv import build_kv_manager

BS = 4
PIN_BUDGET = 4
# Prompts share prefixes (whole blocks and parts of blocks) so the cache has work to do.
SYSTEM_PROMPTS = [
    [1, 2, 3, 1, 2, 3, 1, 2, 3, 1],
    [1, 2, 3, 1, 2, 3, 0, 0],
    [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
    [],
]
tokens = st.integers(0, 3)
index = st.integers(0, 99)

CORE_ACTIONS = [
    st.tuples(
        st.just("admit"), st.integers(0, len(SYSTEM_PROMPTS) - 1), st.lists(tokens, max_size=9), st.integers(1, 12)
    ),
    st.tuples(st.just("readmit"), index, st.integers(1, 12)),
    st.tuples(st.just("step"), index, st.integers(1, 6), tokens),
    st.tuples(st.just("step"), index, st.integers(1, 6), tokens),
    st.tuples(st.just("preempt"), index),
    st.tuples(st.just("swap_out"), index),
    st.tuples(st.just("swap_in"), index),
    st.tuples(st.just("finish"), index),
]
CACHE_ACTIONS = [
    st.tuples(st.just("pin"), index, st.sampled_from(["alice", "bob"])),
    st.tuples(st.just("unpin"), index),
    st.tuples(st.just("evict"), st.integers(1, 8)),
    st.tuples(st.just("evict_host"), st.integers(1, 8)),
]


def _pick(items: list[str], i: int) -> str | None:
    return sorted(items)[i % len(items)] if items else None


def apply(eng: FakeEngine, action: tuple, new_id: str, twin: FakeEngine | None = None) -> object:
    """Apply one manager call the way a scheduler would; returns its outcome.

    With a `twin` (the prefix-cached engine of a differential run), an admission computes as
    many tokens as the twin will have after its cache hit, so both hold the same tokens.
    """
    kind = action[0]
    mgr = eng.mgr
    swapped = [r for r, q in eng.reqs.items() if q.swapped]
    if kind in ("admit", "readmit"):
        if kind == "admit":
            rid, prompt = new_id, SYSTEM_PROMPTS[action[1]] + action[2]
        else:
            rid = _pick(list(eng.waiting), action[1])
            prompt = eng.waiting.get(rid)
        if not prompt:
            return None
        chunk = action[-1]
        total = None
        if twin is not None:
            hit = twin.mgr.match_prefix(prompt).num_tokens
            total = hit + min(len(prompt) - hit, chunk)
        ok = eng.admit(rid, prompt, chunk, total)
        if ok and kind == "readmit":
            del eng.waiting[rid]
        return ok
    if kind == "swap_in":
        rid = _pick(swapped, action[1])
        return rid and eng.swap_in(rid)
    if kind == "pin":
        running = eng.running()
        sources = [eng.reqs[r].tokens[: eng.reqs[r].computed] for r in running]
        path = (sources + [p for p in SYSTEM_PROMPTS if p])[action[1] % (len(sources) + 3)]
        owner = action[2]
        wanted = mgr.prefix_cache.match(path, leave_last_token=False).num_blocks
        fits = (
            mgr.leases.pinned_by(owner) + wanted <= PIN_BUDGET
            and mgr.leases.num_pinned + wanted <= mgr.leases.max_pinned
        )
        pin = eng.pin(owner, path)
        assert (pin is not None) == fits, "pin budget accounting"
        assert pin is None or pin.num_blocks == wanted
        return pin is not None
    if kind == "unpin":
        if eng.pins:
            eng.unpin(action[1] % len(eng.pins))
        return None
    if kind == "evict":
        cache = mgr.prefix_cache
        before = cache.num_evictable_blocks
        freed = cache.evict(action[1])
        assert freed == min(action[1], before)
        return None
    if kind == "evict_host":
        mgr.prefix_cache.evict_host(action[1])
        return None
    rid = _pick(eng.idle_running() + (swapped if kind == "finish" else []), action[1])
    if rid is None:
        return None
    if kind == "step":
        return eng.step(rid, action[2], action[3])
    if kind == "preempt":
        eng.preempt(rid)
    elif kind == "swap_out":
        return eng.swap_out(rid)
    elif kind == "finish":
        eng.finish(rid)
    return rid


def rounds(actions: list) -> st.SearchStrategy:
    """Rounds of calls; the flag says whether the step caches its full blocks."""
    calls = st.lists(st.one_of(actions), min_size=1, max_size=6)
    return st.lists(st.tuples(calls, st.booleans() | st.just(True)), min_size=3, max_size=40)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=rounds(CORE_ACTIONS + CACHE_ACTIONS),
    num_blocks=st.integers(8, 32),
    host_slots=st.sampled_from([0, 6, 24]),
    watermark=st.integers(0, 2),
    spill=st.booleans(),
)
def test_invariants_hold_after_every_call(
    workload: list[tuple[list[tuple], bool]], num_blocks: int, host_slots: int, watermark: int, spill: bool
) -> None:
    mgr = build_kv_manager(
        num_blocks,
        BS,
        watermark_blocks=watermark,
        num_host_slots=host_slots,
        spill_to_host=spill,
        pin_budget_blocks=PIN_BUDGET,
        max_pinned_blocks=num_blocks // 3,
    )
    eng = FakeEngine(mgr)
    for r, (calls, cache) in enumerate(workload):
        for c, action in enumerate(calls):
            apply(eng, action, f"r{r}.{c}")
            eng.check_bookkeeping()
        eng.run_step(cache)
        eng.check_bookkeeping()
        eng.check_content()
    eng.drain()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=rounds(CORE_ACTIONS), num_blocks=st.integers(10, 32), host_slots=st.sampled_from([0, 8, 24]))
def test_prefix_cache_does_not_change_content(
    workload: list[tuple[list[tuple], bool]], num_blocks: int, host_slots: int
) -> None:
    """The same workload with and without the prefix cache: same outcomes, same contents.

    With the cache a request may get more memory (shared blocks), never less, so whenever the
    run without it succeeds the run with it must succeed too; when the plain run fails, the
    call is skipped in both so they stay in step.
    """
    plain = FakeEngine(
        build_kv_manager(num_blocks, BS, watermark_blocks=0, num_host_slots=host_slots, enable_prefix_cache=False)
    )
    cached = FakeEngine(
        build_kv_manager(num_blocks, BS, watermark_blocks=0, num_host_slots=host_slots, spill_to_host=True)
    )
    for r, (calls, cache) in enumerate(workload):
        for c, action in enumerate(calls):
            outcome = apply(plain, action, f"r{r}.{c}", twin=cached)
            if outcome is False:
                continue
            assert apply(cached, action, f"r{r}.{c}") == outcome
            plain.check_bookkeeping()
            cached.check_bookkeeping()
        for eng in (plain, cached):
            eng.run_step(cache)
            eng.check_content()
        assert plain.running() == cached.running()
        for rid in plain.running():
            assert list(plain.content(rid)) == list(cached.content(rid))
    plain.drain()
    cached.drain()
