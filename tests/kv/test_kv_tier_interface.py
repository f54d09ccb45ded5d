"""A second `KVTier` below the host tier: blocks kept in one in-process store that two managers
share (the shape of a cluster-wide pool, issue 56), reached through the same link as the disk
tier. A prompt computed by one manager is loaded, not recomputed, by the other."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
from kv_sim import FakeEngine, as_block_arrays, new_host_array

from jaxserve.kv import HostBlockArrays, KVTier, KVTierStats, LoadStart, build_kv_manager, fingerprint
from jaxserve.kv.kv_tier import LoadJob

BS = 4
FP = fingerprint({"model": "fake", "block_size": BS})


class MemoryTier:
    """One manager's view of a shared store: key -> (token bytes, payload), least recently used first."""

    def __init__(self, store: OrderedDict[bytes, tuple[bytes, bytes]], host: HostBlockArrays, capacity: int) -> None:
        self.kind = "memory"
        self.fingerprint = FP
        self.stats = KVTierStats()
        self.store = store
        self.host = host
        self.capacity_blocks = capacity
        self.closed = False
        self._tickets: dict[int, tuple[bytes, bytes]] = {}
        self._next_ticket = itertools.count()
        self._done: list[LoadJob] = []

    @property
    def tiers(self) -> tuple[KVTier, ...]:
        return (self,)

    @property
    def num_blocks(self) -> int:
        return len(self.store)

    @property
    def num_bytes(self) -> int:
        return sum(len(tokens) + len(payload) for tokens, payload in self.store.values())

    def contains(self, key: bytes) -> bool:
        return key in self.store

    def num_leading(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.store:
            n += 1
        return n

    def touch(self, key: bytes) -> None:
        self.store.move_to_end(key)

    def plan_write(self, key: bytes, tokens: bytes) -> int | None:
        if key in self.store or any(key == k for k, _ in self._tickets.values()):
            return None
        ticket = next(self._next_ticket)
        self._tickets[ticket] = (key, tokens)
        return ticket

    def write(self, tickets: Sequence[int], arrays: Sequence[Any]) -> None:
        for i, ticket in enumerate(tickets):
            key, tokens = self._tickets.pop(ticket)
            self.store[key] = (tokens, b"".join(bytes(part) for part in HostBlockArrays.payload(arrays, i)))
            while len(self.store) > self.capacity_blocks:
                self.store.popitem(last=False)
                self.stats.evictions += 1
            self.stats.written_blocks += 1

    def flush(self) -> None:
        pass

    def can_load(self, num_blocks: int) -> bool:
        return True

    def start_load(self, keys: list[bytes], tokens: list[bytes], host_slots: list[int]) -> LoadJob:
        job = LoadJob(keys, tokens, host_slots, 0)
        for key, block_tokens, host_slot in zip(keys, tokens, host_slots):
            stored = self.store.get(key)
            if stored is None or stored[0] != block_tokens:
                break
            (part,) = self.host.slot_parts(host_slot)  # one array: the payload is that slot's bytes
            part[:] = np.frombuffer(stored[1], np.uint8)
            job.loaded += 1
        job.done = True
        self.stats.loads += 1
        self.stats.loaded_blocks += job.loaded
        self._done.append(job)
        return job

    def poll(self) -> list[LoadJob]:
        done, self._done = self._done, []
        return done

    def wait(self, timeout: float) -> bool:
        return bool(self._done)

    def close(self) -> None:
        self.closed = True

    def check_integrity(self) -> None:
        if len(self.store) > self.capacity_blocks:
            raise AssertionError("the store holds more blocks than its capacity")


def worker(store: OrderedDict[bytes, tuple[bytes, bytes]]) -> FakeEngine:
    host = new_host_array(8, BS)
    tier = MemoryTier(store, HostBlockArrays([as_block_arrays(host)]), capacity=16)
    assert isinstance(tier, KVTier)
    return FakeEngine(build_kv_manager(24, BS, watermark_blocks=0, num_host_slots=8, lower_tier=tier), host=host)


def test_a_prompt_computed_by_one_manager_is_loaded_by_another_from_a_shared_tier() -> None:
    store: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
    a, b = worker(store), worker(store)
    prompt = list(range(100, 113))  # 3 full blocks and 1 token
    assert a.admit("r", prompt, chunk=len(prompt))
    a.run_step()  # its full blocks enter a's cache and are written through to the store
    a.execute_copies()
    assert len(store) == 3

    hit = b.mgr.match_prefix(prompt)
    assert hit.num_tokens == 0 and hit.num_disk_tokens == 12
    assert b.mgr.loads.start("r", hit) is LoadStart.STARTED
    b.execute_copies()  # the planned copies run, then the load is submitted
    assert b.mgr.loads.poll() and not b.mgr.loads.pending
    assert b.admit("r", prompt, chunk=1)  # 12 tokens from the host tier, the last one computed
    b.run_step()
    b.check_bookkeeping()
    b.check_content()
    assert list(b.content("r")) == prompt
    assert b.mgr.stats.host_hit_tokens == 12 and b.mgr.tier_link.hit_tokens == 12
    for eng in (a, b):
        eng.drain()
