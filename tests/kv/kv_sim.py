"""A fake engine that drives a KVCacheManager the way the real one will, with fake KV content.

The "KV" of a token is its token id: a step writes each scheduled token's id into its KV slot, the
planned copies move ids between device blocks and host slots exactly as the runner would move
K/V (stage by stage, each stage one gather then one scatter). A request's block table then must
read back as its token ids, whatever sharing, eviction or swapping happened.

Operations are grouped in rounds like the engine's: scheduling calls plan copies and writes,
`run_step()` executes the copies, then the writes, then caches the blocks that filled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.kv import CopyKind, CopyStage, KVCacheManager, KVHandle, Pin, RadixCache
from jaxserve.kv.content_keys import ChainKeys

EMPTY = -1


def new_host_array(num_host_slots: int, block_size: int) -> np.ndarray:
    return np.full((max(num_host_slots, 1), block_size), EMPTY, dtype=np.int64)


def as_block_arrays(space: np.ndarray) -> np.ndarray:
    """A [host slots, block_size] space seen as the runner's layout, host slot on axis 2 (a view)."""
    return space.reshape(1, 1, *space.shape)


@dataclass
class Req:
    tokens: list[int]
    kv: KVHandle
    computed: int = 0  # tokens with KV written or being written this round
    swapped: bool = False


@dataclass
class PinRecord:
    pin: Pin
    tokens: list[int]


@dataclass
class FakeEngine:
    mgr: KVCacheManager
    reqs: dict[str, Req] = field(default_factory=dict)
    waiting: dict[str, list[int]] = field(default_factory=dict)  # preempted to recompute
    pins: list[PinRecord] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)  # has writes pending in this round
    pending: list[tuple[str, int, int]] = field(default_factory=list)
    host: np.ndarray | None = None  # host slots' content (made here unless a disk tier shares it)

    def __post_init__(self) -> None:
        pool = self.mgr.pool
        self.bs = pool.block_size
        self.device = np.full((pool.num_blocks, self.bs), EMPTY, dtype=np.int64)
        if self.host is None:
            self.host = new_host_array(self.mgr.host.num_host_slots, self.bs)

    # ------------------------------------------------------------- scheduling calls

    def running(self) -> list[str]:
        return [r for r, q in self.reqs.items() if not q.swapped]

    def idle_running(self) -> list[str]:
        """Running requests not scheduled this round (the ones a scheduler may preempt)."""
        return [r for r in self.running() if r not in self.busy]

    def admit(
        self, rid: str, tokens: list[int], chunk: int, total: int | None = None, chain: ChainKeys | None = None
    ) -> bool:
        """Admit with a prefill chunk of `chunk` tokens after the cached prefix, or so that
        `total` tokens are computed after this round (to keep two engines in step); `chain`: the
        request's content keys (a LoRA request's are salted), else the manager's."""
        mgr = self.mgr
        hit = mgr.match_prefix(tokens, chain)
        assert hit.num_tokens % self.bs == 0 and hit.num_tokens <= max(len(tokens) - 1, 0)
        n = min(len(tokens) - hit.num_tokens, chunk) if total is None else total - hit.num_tokens
        can = mgr.can_admit(hit, n)
        handle = mgr.admit(hit, n, load_key=rid)
        assert (handle is not None) == can
        if handle is not None:
            self.reqs[rid] = Req(list(tokens), handle, hit.num_tokens + n)
            self._schedule(rid, hit.num_tokens, hit.num_tokens + n)
            assert handle.num_tokens == hit.num_tokens + n
        return handle is not None

    def step(self, rid: str, chunk: int, new_token: int) -> bool:
        req = self.reqs[rid]
        decode = req.computed == len(req.tokens)
        if decode:
            req.tokens.append(new_token)  # the token sampled by the previous step
        n = min(chunk, len(req.tokens) - req.computed)
        ok = self.mgr.allocate_kv_slots(req.kv, n)
        if ok:
            self._schedule(rid, req.computed, req.computed + n)
            req.computed += n
        elif decode:
            req.tokens.pop()
        return ok

    def _schedule(self, rid: str, start: int, stop: int) -> None:
        self.busy.add(rid)
        self.pending.append((rid, start, stop))

    def preempt(self, rid: str) -> None:
        req = self.reqs.pop(rid)
        self.mgr.free(req.kv)
        self.waiting[rid] = req.tokens

    def swap_out(self, rid: str) -> bool:
        req = self.reqs[rid]
        ok = self.mgr.swap_out(req.kv)
        if ok:
            req.swapped = True
            assert req.kv.host_slots is not None and len(req.kv.block_table) == 0
        return ok

    def swap_in(self, rid: str) -> bool:
        req = self.reqs[rid]
        can = self.mgr.can_swap_in(req.kv)
        ok = self.mgr.swap_in(req.kv)
        assert ok == can
        if ok:
            req.swapped = False
        return ok

    def finish(self, rid: str) -> None:
        self.mgr.free(self.reqs.pop(rid).kv)

    def table(self, rid: str) -> np.ndarray:
        return self.reqs[rid].kv.block_table

    def pin(self, owner: str, tokens: list[int]) -> Pin | None:
        pin = self.mgr.leases.pin(owner, tokens)
        if pin is not None:
            self.pins.append(PinRecord(pin, list(tokens[: pin.num_tokens])))
        return pin

    def unpin(self, index: int) -> None:
        record = self.pins.pop(index)
        self.mgr.leases.unpin(record.pin)

    # ------------------------------------------------------------- the runner's part

    def run_step(self, cache: bool = True) -> None:
        """Copies, then the step's writes, then (unless told not to) caching of full blocks.

        A scheduler may cache lazily; skipping it leaves full blocks uncached for a while.
        """
        self.execute_copies()
        for rid, start, stop in self.pending:
            if rid in self.reqs and not self.reqs[rid].swapped:
                kv_slots = self.reqs[rid].kv.kv_slots(start, stop)
                self.device.reshape(-1)[kv_slots] = self.reqs[rid].tokens[start:stop]
        self.pending.clear()
        self.busy.clear()
        for rid in self.running() if cache else []:
            req = self.reqs[rid]
            cached = self.mgr.cache_full_blocks(req.kv, req.tokens[: req.computed])
            assert cached <= req.computed // self.bs

    def execute_copies(self, stages: list[CopyStage] | None = None) -> None:
        """Run `stages` (default: whatever the manager planned) the way the runner would."""
        spaces = {
            CopyKind.DEVICE_TO_HOST: (self.device, self.host),
            CopyKind.HOST_TO_DEVICE: (self.host, self.device),
        }
        to_disk = {CopyKind.DEVICE_TO_DISK: self.device, CopyKind.HOST_TO_DISK: self.host}
        for stage in self.mgr.take_copies() if stages is None else stages:
            if stage.kind in to_disk:  # the block as it is now, handed to the writer thread
                self.mgr.tier_link.tier.write(stage.dst, [as_block_arrays(to_disk[stage.kind][stage.src])])
                continue
            src, dst = spaces[stage.kind]
            assert len(set(stage.dst)) == len(stage.dst), "a stage writes one place twice"
            values = src[stage.src]  # one gather ...
            dst[stage.dst] = values  # ... then one scatter
        self.mgr.loads.submit()  # disk reads into host slots these copies may have read

    # ------------------------------------------------------------- checks

    def content(self, rid: str) -> np.ndarray:
        n = self.reqs[rid].computed
        return self.device[self.table(rid)].reshape(-1)[:n]

    def check_bookkeeping(self) -> None:
        """What must hold after every call: the manager's own check plus an independent recount."""
        mgr = self.mgr
        mgr.check_integrity()
        pool = mgr.pool
        holders = np.zeros(pool.num_blocks, dtype=np.int64)
        for req in self.reqs.values():
            table = req.kv.block_table
            if req.swapped:
                assert len(table) == 0
                continue
            assert len(table) == -(-req.kv.num_tokens // self.bs), "table does not cover tokens"
            assert req.kv.num_tokens == req.computed
            np.add.at(holders, table[req.kv.num_dropped :], 1)  # dropped: out of a sliding window
        cache = mgr.prefix_cache
        np.add.at(holders, np.fromiter(cache.device_blocks(), dtype=np.int64), 1)
        assert holders[0] == 0, "block 0 was handed out"
        assert list(holders) == pool.refcount, "refcounts differ from the number of holders"
        assert pool.num_free == int((holders[1:] == 0).sum()), "free xor referenced"
        usage = mgr.usage()
        assert usage.free + usage.used + usage.pinned + usage.cached_idle == usage.num_blocks
        for record in self.pins:  # pinned paths are never evicted
            match = cache.match(record.tokens, leave_last_token=False)
            assert match.num_tokens == record.pin.num_tokens

    def check_content(self) -> None:
        """After run_step: every running request's blocks read back as its tokens, and every
        cached block as its key."""
        assert not self.pending
        for rid in self.running():
            req = self.reqs[rid]
            kept = req.kv.num_dropped * self.bs  # positions before: out of a sliding window
            content = self.content(rid)[kept:]
            np.testing.assert_array_equal(content, req.tokens[kept : req.computed], err_msg=f"content of {rid}")
        cache = self.mgr.prefix_cache
        for node in cache.nodes() if isinstance(cache, RadixCache) else []:
            key = np.frombuffer(node.key, dtype=np.int32).reshape(-1, self.bs)
            stored = self.device[node.blocks] if node.blocks is not None else self.host[node.host_slots]
            np.testing.assert_array_equal(stored, key, err_msg="cached block content")

    def clear_cache(self) -> None:
        """Drop every idle cached block (both tiers, nothing written to a lower tier)."""
        if isinstance(self.mgr.prefix_cache, RadixCache):
            self.mgr.prefix_cache.clear()

    def drain(self) -> None:
        """Finish everything, release pins, clear the cache: the pool must be whole again."""
        self.run_step()
        for rid in list(self.reqs):
            self.finish(rid)
        while self.pins:
            self.unpin(0)
        self.clear_cache()
        self.execute_copies()
        self.check_bookkeeping()
        pool = self.mgr.pool
        assert pool.num_free == pool.num_usable, "blocks leaked"
        assert self.mgr.host.num_free == self.mgr.host.num_host_slots, "host slots leaked"
        usage = self.mgr.usage()
        assert usage.free == usage.num_blocks and usage.used == usage.cached == 0


def random_blocks(seed: int, n: int, shape: tuple[int, ...]) -> tuple[list[bytes], list[bytes], list[np.ndarray]]:
    """n random blocks for host arrays of `shape` (layers, kv heads, slots, block size, head dim):
    their keys, token bytes, and K and V arrays with the blocks on axis 2."""
    rng = np.random.default_rng(seed)
    layers, heads, _, block_size, head_dim = shape
    keys = [rng.bytes(16) for _ in range(n)]
    tokens = [rng.integers(0, 1000, block_size, dtype=np.int32).tobytes() for _ in range(n)]
    arrays = [rng.standard_normal((layers, heads, n, block_size, head_dim), np.float32) for _ in range(2)]
    return keys, tokens, arrays
