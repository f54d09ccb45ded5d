"""Snapshots of a hybrid's state: a hit is cut to the deepest block boundary with a snapshot,
admission restores it into the sequence's slot (a planned STATE copy), snapshots are evicted least
recently used first and give their slot to a sequence when none is free; nothing leaks."""

from jaxserve.kv import CopyKind, build_kv_manager

BS = 4


def admit(mgr, tokens: list[int], chain=None):
    hit = mgr.match_prefix(tokens, chain)
    return mgr.admit(hit, len(tokens) - hit.num_tokens), hit


def run(mgr, tokens: list[int], snapshot_blocks: int):
    """Admit, compute and cache `tokens`, keep the state at `snapshot_blocks` blocks; return the handle and hit."""
    handle, hit = admit(mgr, tokens)
    mgr.cache_full_blocks(handle, tokens)
    mgr.snapshots.save(handle, tokens, snapshot_blocks)
    return handle, hit


def test_hits_are_cut_to_snapshots_and_restored():
    mgr = build_kv_manager(64, BS, num_state_slots=6, num_state_snapshots=2)
    prompt = list(range(100, 122))  # 5 full blocks and 2 tokens
    first, hit = run(mgr, prompt, 3)
    assert hit.num_tokens == 0
    [stage] = mgr.take_copies()
    assert stage.kind is CopyKind.STATE and stage.pairs == [(first.state_slot, mgr.snapshots.held_slots()[0])]
    mgr.free(first)
    again, hit = admit(mgr, prompt + [7, 8, 9])  # 5 blocks cached, a snapshot at 3
    assert hit.num_tokens == 3 * BS
    [stage] = mgr.take_copies()
    assert stage.kind is CopyKind.STATE and stage.pairs == [(mgr.snapshots.held_slots()[0], again.state_slot)]
    mgr.free(again)
    other, hit = admit(mgr, list(range(500, 510)))
    assert hit.num_tokens == 0 and not mgr.take_copies()
    mgr.free(other)
    mgr.check_integrity()


def test_snapshots_are_evicted_lru_and_yield_slots_to_sequences():
    mgr = build_kv_manager(64, BS, num_state_slots=3, num_state_snapshots=2)  # 2 usable slots
    a, _ = run(mgr, list(range(10, 19)), 2)
    assert mgr.snapshots.num_held == 1 and mgr.state_slots.num_free == 0
    b, _ = admit(mgr, list(range(30, 35)))  # no free slot: the snapshot gives its slot
    assert mgr.snapshots.num_held == 0 and b.state_slot is not None
    mgr.check_integrity()
    hit = mgr.match_prefix(list(range(50, 55)))
    assert not mgr.can_admit(hit, 5)  # two sequences, no snapshot to evict
    mgr.free(a)
    mgr.free(b)
    mgr.check_integrity()
    assert mgr.state_slots.num_free == 2
