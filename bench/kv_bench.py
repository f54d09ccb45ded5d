"""Micro-benchmark of the KV bookkeeping in `jaxserve.kv` (host CPU, plain Python + numpy).

    python3 -m bench.kv_bench [--quick]

Prints microseconds per operation: allocate+free per block, `match` of a 4,096-token prompt
against a tree holding 100,000 blocks, `insert`, eviction, and the bookkeeping of one decode step
for 64 running requests, which is compared with a ~160 ms decode step of the default model at
batch 64 on the dev CPU (the goal is < 1%). Figures are medians of several repeats of the
process's CPU time (`time.process_time`), which other load on a shared machine disturbs less
than wall time does; still, read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from jaxserve.kv import BlockPool, RadixCache, build_kv_manager

BS = 16
PROMPT = 4096
DECODE_STEP_MS = 160.0  # default model, batch 64, dev CPU (shared/FACTS.md)


def median_us(
    fn: Callable[[], object], number: int, repeat: int = 5, setup: Callable[[], object] | None = None
) -> float:
    """Median over `repeat` runs of the time per call of `fn` (called `number` times per run)."""
    runs = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.process_time()
        for _ in range(number):
            fn()
        runs.append((time.process_time() - start) / number * 1e6)
    return statistics.median(runs)


def report(name: str, us: float, note: str = "") -> None:
    print(f"{name:<58} {us:>10.2f} us  {note}")


def bench_pool() -> None:
    pool = BlockPool(100_001, BS)

    def one() -> None:
        pool.decref(pool.allocate(1)[0])

    report("pool: allocate(1) + free, per block", median_us(one, 20_000))

    def batch() -> None:
        pool.decref_all(pool.allocate(64))

    report("pool: allocate(64) + free, per block", median_us(batch, 2_000) / 64)


def _cache_prompt(cache: RadixCache, tokens: np.ndarray | list[int]) -> None:
    """What admitting and finishing a prompt of whole blocks does to the tree: match, fill the
    rest with new blocks, release."""
    pool = cache.pool
    match = cache.match(tokens, leave_last_token=False)
    cache.lock(match.path)
    fresh = pool.allocate(len(tokens) // BS - match.num_blocks)
    result = cache.insert(tokens[match.num_tokens :], fresh, parent=match.path)
    cache.unlock(match.path)
    cache.unlock(result.path)
    pool.decref_all(fresh)


def build_tree(num_blocks: int, rng: np.random.Generator) -> tuple[RadixCache, list[np.ndarray]]:
    """A tree of 4,096-token conversations: 10 system prompts of 64 blocks, unique rest."""
    pool = BlockPool(num_blocks + 4 * PROMPT // BS + 64, BS)
    cache = RadixCache(pool)
    systems = [rng.integers(0, 49152, 64 * BS, dtype=np.int32) for _ in range(10)]
    sequences = []
    while cache.num_device_blocks + PROMPT // BS <= num_blocks:
        tokens = np.concatenate(
            [systems[len(sequences) % 10], rng.integers(0, 49152, PROMPT - 64 * BS, dtype=np.int32)]
        )
        _cache_prompt(cache, tokens)
        sequences.append(tokens)
    return cache, sequences


def bench_tree(num_blocks: int, rng: np.random.Generator) -> None:
    cache, sequences = build_tree(num_blocks, rng)
    print(f"tree: {cache.num_device_blocks} blocks, {len(list(cache.nodes()))} nodes")
    hit = sequences[3].tolist() + [7]  # a list of ints, as a scheduler holds it
    assert cache.match(hit).num_tokens == PROMPT
    report("match: 4096-token prompt, full hit (list input)", median_us(lambda: cache.match(hit), 200))
    hit_np = np.asarray(hit, dtype=np.int32)
    report("match: 4096-token prompt, full hit (numpy input)", median_us(lambda: cache.match(hit_np), 200))
    partial = sequences[4][: 64 * BS].tolist() + rng.integers(0, 49152, PROMPT - 64 * BS).tolist()
    report("match: 4096-token prompt, system prompt hit only", median_us(lambda: cache.match(partial), 200))
    miss = rng.integers(0, 49152, PROMPT).tolist()
    report("match: 4096-token prompt, miss", median_us(lambda: cache.match(miss), 200))

    # A path made of 255 one-block nodes (a branch at every block): the worst case for depth.
    deep = rng.integers(0, 49152, PROMPT).tolist()
    for cut in range(1, PROMPT // BS):
        _cache_prompt(cache, deep[: cut * BS] + [1] * BS)
    deep_hit = deep + [7]
    cache.match(deep_hit)
    report("match: 4096-token prompt through 255 one-block nodes", median_us(lambda: cache.match(deep_hit), 200))

    # Insert of a new 4,096-token conversation below a cached system prompt (192 new blocks).
    tokens_new: list[np.ndarray] = []

    def insert_setup() -> None:
        tokens_new.clear()
        tokens_new.append(
            np.concatenate([sequences[5][: 64 * BS], rng.integers(0, 49152, PROMPT - 64 * BS, dtype=np.int32)])
        )

    def insert() -> None:
        _cache_prompt(cache, tokens_new[0])
        cache.evict(PROMPT // BS - 64)  # keep the tree size steady

    report(
        "insert: 4096-token prompt, 192 new blocks (+match, +evict)",
        median_us(insert, 1, repeat=15, setup=insert_setup),
    )

    calls = min(50, cache.num_evictable_blocks // 64 // 10)
    report("evict: 64 blocks from idle leaves (drop), per block", median_us(lambda: cache.evict(64), calls) / 64)


def bench_spill(rng: np.random.Generator) -> None:
    mgr = build_kv_manager(20_001, BS, watermark_blocks=200, num_host_slots=20_000)  # a served engine's 1%
    cache = mgr.prefix_cache
    pool = mgr.pool
    for _ in range(70):
        tokens = rng.integers(0, 49152, PROMPT, dtype=np.int32)
        blocks = pool.allocate(PROMPT // BS)
        cache.unlock(cache.insert(tokens, blocks).path)
        pool.decref_all(blocks)

    def spill() -> None:
        cache.evict(64)
        mgr.take_copies()

    report("evict: 64 blocks, spilled to host tier, per block", median_us(spill, 50) / 64)


def bench_decode_step(batch: int, context: int, steps: int, rng: np.random.Generator) -> None:
    """The manager's share of one decode step for `batch` running requests."""
    num_blocks = batch * (context + steps) // BS + 2 * batch + 1
    mgr = build_kv_manager(num_blocks, BS, watermark_blocks=(num_blocks - 1) // 100)  # a served engine's 1%
    token_lists, handles = [], []
    for _ in range(batch):
        prompt = rng.integers(0, 49152, context).tolist()
        hit = mgr.match_prefix(prompt)
        handle = mgr.admit(hit, len(prompt) - hit.num_tokens)
        assert handle is not None
        mgr.cache_full_blocks(handle, prompt)
        token_lists.append(prompt)
        handles.append(handle)

    def step() -> None:
        for tokens, handle in zip(token_lists, handles):
            position = len(tokens)
            tokens.append(position % 49152)  # the token sampled last step
            mgr.allocate_kv_slots(handle, 1)
            _ = handle.block_table  # the property builds the table: part of what is timed
            handle.kv_slots(position, position + 1)
        mgr.take_copies()
        for tokens, handle in zip(token_lists, handles):  # after the step: cache filled blocks
            mgr.cache_full_blocks(handle, tokens)

    us = median_us(step, steps // 5, repeat=5)
    report(
        f"decode step bookkeeping, batch {batch}, context {context}",
        us,
        f"= {us / 1e3 / DECODE_STEP_MS * 100:.3f}% of a {DECODE_STEP_MS:.0f} ms step",
    )
    for handle in handles:
        mgr.free(handle)
    mgr.check_integrity()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    tree_blocks = 5_000 if args.quick else 100_000
    print(f"jaxserve.kv micro-benchmark (block size {BS})")
    bench_pool()
    bench_tree(tree_blocks, rng)
    bench_spill(rng)
    bench_decode_step(8 if args.quick else 64, 1024, 40 if args.quick else 320, rng)


if __name__ == "__main__":
    main()
