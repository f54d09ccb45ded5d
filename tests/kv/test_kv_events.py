"""KV events: the prefix cache's changes as content keys, and the router's index of them. A
prompt's full blocks are recorded as stored with the keys a router computes from the prompt;
blocks evicted for good are recorded as removed (spilled to the host tier, they stay); a reader
that fell behind the log gets a snapshot instead."""

from __future__ import annotations

from kv_sim import FakeEngine

from jaxserve.kv import build_kv_manager
from jaxserve.kv.content_keys import ChainKeys, chain_keys, content_token_bytes, salt_token, token_bytes
from jaxserve.kv.kv_events import KVEventLog
from jaxserve.placement.kv_index import KVIndex

BS = 4


def engine(num_blocks: int = 16, host_slots: int = 0) -> FakeEngine:
    return FakeEngine(build_kv_manager(num_blocks, BS, watermark_blocks=0, num_host_slots=host_slots, kv_events=True))


def follow(log: KVEventLog) -> tuple[KVIndex, int]:
    seq, keys = log.snapshot()
    return KVIndex(log.seed, BS, keys), seq


def test_a_cached_prompt_is_stored_and_a_router_index_matches_its_full_blocks():
    eng = engine()
    log = eng.mgr.events
    index, seq = follow(log)
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks
    assert eng.admit("a", prompt, chunk=14)
    eng.run_step()
    batches = log.since(seq)
    assert [k for b in batches for k in b.stored] == chain_keys(log.seed, prompt, 3, BS)
    for b in batches:
        index.apply(b.stored, b.removed, b.cleared)
    assert index.match(prompt) == 12 and index.match([*prompt[:8], 99, 99, 99, 99]) == 8
    assert index.match([99] * 14) == 0 and index.match(prompt[:3]) == 0
    eng.finish("a")
    assert follow(log)[0].match(prompt) == 12  # idle in the cache: still served from it


def test_evicted_blocks_are_removed_and_spilled_ones_stay():
    spilled = engine(num_blocks=5, host_slots=8)  # 4 usable blocks
    evicted = engine(num_blocks=5)
    for eng in (spilled, evicted):
        assert eng.admit("a", list(range(10, 26)), chunk=16)  # 4 blocks
        eng.run_step()
        eng.finish("a")
        assert eng.admit("b", list(range(50, 66)), chunk=16)  # evicts a's
        eng.run_step()
        eng.finish("b")
    assert follow(spilled.mgr.events)[0].match(list(range(10, 26))) == 16  # on the host tier now
    index, _ = follow(evicted.mgr.events)
    assert index.match(list(range(10, 26))) == 0 and index.match(list(range(50, 66))) == 16


def test_a_reader_behind_the_log_takes_a_snapshot():
    log = KVEventLog(bytes(16), max_events=2)
    for i in range(4):
        log.stored([bytes([i]) * 16])
    assert log.since(0) is None and len(log.since(2)) == 2 and log.since(4) == []
    log.removed([bytes([0]) * 16])
    seq, keys = log.snapshot()
    assert seq == 5 and keys == {bytes([i]) * 16 for i in (1, 2, 3)}


def test_lora_content_keys_do_not_depend_on_the_engines_own_adapter_number():
    """A LoRA request's cache tokens carry this engine's number for its adapter in their first token
    (the radix tree keeps adapters apart by it); its content keys, which the tiers, the pool and a
    router share, hash the token unsalted from a seed salted by the adapter's weights digest."""
    seed, digest = bytes(range(16)), b"weights digest"
    prompt = list(range(10, 22))  # 3 blocks
    here, there = ([salt_token(uid, prompt[0]), *prompt[1:]] for uid in (3, 7))
    keys = ChainKeys(seed, BS).salted(digest).keys(here, 3)
    assert keys == ChainKeys(seed, BS).salted(digest).keys(there, 3)  # another engine numbers it 7
    assert keys != chain_keys(seed, prompt, 3, BS)  # not the base model's
    assert keys != ChainKeys(seed, BS).salted(b"other weights").keys(here, 3)
    assert KVIndex(seed, BS, keys).match(prompt, digest) == 12 and KVIndex(seed, BS, keys).match(prompt) == 0
    assert token_bytes(here, 4) != token_bytes(there, 4) != token_bytes(prompt, 4)  # the radix tree's keys
    # only a sequence's first token is a LoRA salt: salted ids later on (an image's soft tokens) are content
    image = [*prompt[:4], -5, -6, -7, -8]
    assert content_token_bytes(image, 4, 8) == token_bytes(image[4:], 4)
    assert content_token_bytes(here, 0, 4) == token_bytes(prompt, 4)


def test_a_lora_prompts_blocks_are_stored_and_removed_under_its_salted_keys():
    """A LoRA request's blocks (cache tokens with a salted first token, content keys from the seed
    salted by its adapter's digest) enter the events under those keys, which a router matches with the
    digest, and leave them under the same keys when they are evicted."""
    eng = engine(num_blocks=5)  # 4 usable blocks
    log, digest = eng.mgr.events, b"weights digest"
    prompt = list(range(10, 26))  # 4 blocks
    assert eng.admit("a", [salt_token(2, prompt[0]), *prompt[1:]], chunk=16, chain=eng.mgr.new_chain().salted(digest))
    eng.run_step()
    eng.finish("a")
    index, seq = follow(log)
    assert index.match(prompt, digest) == 16 and index.match(prompt) == 0
    assert eng.admit("b", list(range(50, 66)), chunk=16)  # evicts a's blocks
    eng.run_step()
    for b in log.since(seq):
        index.apply(b.stored, b.removed, b.cleared)
    assert index.match(prompt, digest) == 0 and index.match(list(range(50, 66))) == 16
    assert index.keys == set(follow(log)[0].keys)  # what the events said is what the log holds
