"""A worker's side of prefill/decode disaggregation: leases on a prefill worker, pulls on a decode one.

Prefill: a `hold_kv` request runs as any other (the router asks for one token); when it ends by
length, the prompt's full cached blocks are held on the engine thread at once (`on_finish`,
before a later step could evict them) under a lease that its last message carries. A decode
worker pulls the blocks with `PullKV` and releases the lease (the ack); an Abort of the request
or the lease's timeout releases it too, so a decode worker that never comes leaks nothing.

Decode: before a `kv_source` request is admitted, the blocks its prefix cache holds of the prompt
are held and skipped, the rest pulled from the prefill worker, written into fresh blocks and
added to the cache (`jaxserve.kv_transfer`); the lease is released, and the request is admitted
as usual: a prefix hit up to the last full block, the partial block and the first output token
recomputed. A pull that fails leaves the request to recompute what did not arrive.

Transport: bytes over `PullKV` (gRPC), or, where both workers run with `--kv-transport device`,
device to device: the decode worker asks the prefill worker to stage the blocks (`StageKV`) and
pulls them from the transfer server its lease names (`jaxserve.kv_transfer.DeviceTransfer`);
if that fails it falls back to `PullKV`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import jax
import numpy as np

from jaxserve.async_engine import AsyncEngine
from jaxserve.dp_router import DataParallelRouter
from jaxserve.kv import Hold
from jaxserve.kv_tiers import kv_fingerprint
from jaxserve.kv_transfer import (DeviceTransfer, block_layout, hold_prompt, prompt_key, read_blocks, release,
                                  stage_blocks, write_blocks, write_staged_blocks)
from jaxserve.outputs import Delta
from jaxserve.request import FinishReason
from server.worker_api import worker_pb2 as pb
from server.worker_api.worker_pb2_grpc import WorkerStub

logger = logging.getLogger(__name__)

READ_BLOCKS = 32  # blocks read out per call on the engine thread
MAX_MESSAGE_BYTES = 8 << 20  # K and V bytes in one KVBlocks message
PEER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + (1 << 20))]
PULL_TIMEOUT = 120.0  # seconds a pull may take
STAGE_TIMEOUT = 30.0  # seconds staged device arrays wait for their pull
SWEEP_INTERVAL = 0.2  # seconds between checks for leases past their timeout


class LeaseGoneError(LookupError):
    """The lease was released (ack, abort or timeout) before the blocks were read."""


# Writes pulled blocks into the decode engine's cache: (engine, hold, prompt ids) -> the longer hold.
WriteInto = Callable[[Any, Hold, list[int]], Hold]


class TransferFailed(Exception):
    """A pull that did not bring the blocks (the message says why)."""


@dataclasses.dataclass(eq=False)
class Lease:
    lease_id: int
    request_id: str
    hold: Hold
    key: bytes
    expires_at: float


class LeaseTable:
    """Leases by id; filled on the engine thread, read and emptied on the event loop (locked)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)

    def add(self, request_id: str, hold: Hold, key: bytes) -> Lease:
        with self._lock:
            lease = Lease(next(self._ids), request_id, hold, key, time.monotonic() + self.timeout)
            self._leases[lease.lease_id] = lease
            return lease

    def get(self, lease_id: int) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def of_request(self, request_id: str) -> Lease | None:
        with self._lock:
            return next((x for x in reversed(self._leases.values()) if x.request_id == request_id), None)

    def pop(self, lease_id: int) -> Lease | None:
        with self._lock:
            return self._leases.pop(lease_id, None)

    def pop_request(self, request_id: str) -> list[Lease]:
        with self._lock:
            gone = [x for x in self._leases.values() if x.request_id == request_id]
            for lease in gone:
                del self._leases[lease.lease_id]
            return gone

    def pop_expired(self, now: float) -> list[Lease]:
        with self._lock:
            gone = [x for x in self._leases.values() if x.expires_at <= now]
            for lease in gone:
                del self._leases[lease.lease_id]
            return gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)


class KVHandoff:
    def __init__(self, engine: AsyncEngine, lease_timeout: float, transfer_host: str | None = None) -> None:
        """With `transfer_host` (an address other workers reach), blocks move device to device
        through a transfer server there where the other side has one too; else as bytes only."""
        if len(engine.engine.replicas) != 1:
            raise ValueError("prefill and decode workers run one engine replica (no --data-parallel-size)")
        replica = engine.engine.replicas[0]
        self._engine = engine
        self.fingerprint = kv_fingerprint(replica.runner, replica.model_name)
        self.layout = block_layout(replica)
        self.block_size = replica.config.block_size
        self.device = DeviceTransfer(replica, transfer_host) if transfer_host is not None else None
        self.leases = LeaseTable(lease_timeout)
        self._peers: dict[str, tuple[grpc.aio.Channel, WorkerStub]] = {}
        self._sweeper: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    def start(self) -> None:
        """Start releasing leases past their timeout (call inside the serving event loop)."""
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        for channel, _ in self._peers.values():
            await channel.close()

    # ----- prefill side ----------------------------------------------------------------------

    def hold_on_finish(self, request_id: str, prompt_ids: list[int]) -> Callable[[DataParallelRouter, Delta], None]:
        """The engine-thread hook that leases the prompt's blocks when the sequence ends by length."""
        def on_finish(router: DataParallelRouter, delta: Delta) -> None:
            if delta.finish_reason != FinishReason.LENGTH.value:
                return
            engine = router.replicas[0]
            hold = hold_prompt(engine, prompt_ids)
            if hold.num_blocks == 0:
                release(engine, hold)
                return
            self.leases.add(request_id, hold, prompt_key(self.fingerprint, prompt_ids, hold.num_blocks, self.block_size))
        return on_finish

    def lease_message(self, request_id: str) -> pb.KVLease | None:
        lease = self.leases.of_request(request_id)
        if lease is None:
            return None
        return pb.KVLease(lease_id=lease.lease_id, num_blocks=lease.hold.num_blocks, last_key=lease.key,
                          timeout_s=self.leases.timeout, transfer_address=self.device.address if self.device else "")

    def _leased_range(self, request: pb.PullKVRequest) -> tuple[Lease, int, int]:
        lease = self.leases.get(request.lease_id)
        if lease is None:
            raise LeaseGoneError(f"no lease {request.lease_id} (released or timed out)")
        first, end = request.first_block, request.first_block + request.num_blocks
        if end > lease.hold.num_blocks:
            raise ValueError(f"blocks [{first}, {end}) asked for, the lease holds {lease.hold.num_blocks}")
        return lease, first, end

    def _still_leased(self, lease_id: int) -> None:
        """On the engine thread, before reading a lease's blocks: a released lease's may be gone."""
        if self.leases.get(lease_id) is None:
            raise LeaseGoneError(f"lease {lease_id} was released during the pull")

    async def read(self, request: pb.PullKVRequest) -> AsyncIterator[pb.KVBlocks]:
        """The leased blocks asked for, K and V bytes, at most MAX_MESSAGE_BYTES a message.
        LeaseGoneError when the lease is not (or no longer) held; ValueError for a bad range."""
        lease, first, end = self._leased_range(request)
        per_message = max(1, MAX_MESSAGE_BYTES // self.layout.block_bytes)
        for start in range(first, end, READ_BLOCKS):
            count = min(READ_BLOCKS, end - start)

            def read_out(router: DataParallelRouter, start: int = start, count: int = count):
                self._still_leased(request.lease_id)
                return read_blocks(router.replicas[0], lease.hold, start, count)

            arrays = await self._engine.between_steps(read_out)
            if arrays is None:
                raise LeaseGoneError("the engine loop is not running")
            k, v = arrays
            for j in range(0, count, per_message):
                part = slice(j, j + per_message)
                yield pb.KVBlocks(first_block=start + j, num_blocks=k[:, :, part].shape[2],
                                  k=k[:, :, part].tobytes(), v=v[:, :, part].tobytes())

    async def stage(self, request: pb.PullKVRequest) -> pb.StageKVResponse:
        """Offer the leased blocks asked for to one device-to-device pull (for STAGE_TIMEOUT
        seconds). LookupError when this worker has no transfer server or the lease is gone,
        ValueError for a bad range."""
        if self.device is None:
            raise LookupError("this worker moves KV as bytes only (--kv-transport grpc)")
        lease, first, end = self._leased_range(request)
        device = self.device

        def offer(router: DataParallelRouter) -> pb.StageKVResponse:
            self._still_leased(request.lease_id)
            arrays = stage_blocks(router.replicas[0], lease.hold, first, end - first)
            return pb.StageKVResponse(transfer_id=device.offer(arrays, STAGE_TIMEOUT), num_chunks=len(arrays) // 2,
                                      chunk_blocks=device.chunk_shape[2])

        staged = await self._engine.between_steps(offer)
        if staged is None:
            raise LeaseGoneError("the engine loop is not running")
        return staged

    async def release_lease(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id)
        if lease is not None:
            await self._release(lease.hold)
        return lease is not None

    async def abort(self, request_id: str) -> None:
        for lease in self.leases.pop_request(request_id):
            await self._release(lease.hold)

    def drop_leases(self, request_id: str) -> None:
        """`abort`'s releases in the background (safe in a cancelled task)."""
        for lease in self.leases.pop_request(request_id):
            self.release_hold(lease.hold)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            for lease in self.leases.pop_expired(time.monotonic()):
                logger.warning("KV lease %d of request %s timed out unpulled", lease.lease_id, lease.request_id)
                await self._release(lease.hold)

    # ----- decode side -----------------------------------------------------------------------

    async def pull_into_cache(self, prompt_ids: list[int], source: pb.KVSource) -> tuple[Hold | None, pb.KVTransfer]:
        """Get the lease's blocks into this engine's prefix cache, held (release the hold once the
        request is admitted), and release the lease. Returns the hold (None if none was made)
        and how the transfer went; a failed transfer leaves the request to recompute."""
        t0 = time.perf_counter()
        lease, bs = source.lease, self.block_size
        stats = pb.KVTransfer()
        hold = None
        try:
            if lease.num_blocks * bs > len(prompt_ids):
                stats.error = f"the lease holds {lease.num_blocks} blocks, the prompt has {len(prompt_ids)} tokens"
            elif prompt_key(self.fingerprint, prompt_ids, lease.num_blocks, bs) != lease.last_key:
                stats.error = "the prefill worker's KV does not fit here (other tokens, weights, dtype or layout)"
            else:
                hold = await self._holding(lambda r: hold_prompt(r.replicas[0], prompt_ids, lease.num_blocks))
                if hold is None:
                    stats.error = "the engine loop is not running"
                else:
                    stats.blocks_skipped = hold.num_blocks
                    hold = await self._pull(prompt_ids, source, hold, stats)
        except asyncio.CancelledError:  # the request went away mid-transfer
            self.release_hold(hold)
            raise
        finally:
            self._in_background(self._ack(source))  # the request need not wait for it
            stats.seconds = time.perf_counter() - t0
        if stats.error:
            logger.warning("KV transfer from %s: %s", source.address, stats.error)
        return hold, stats

    async def _pull(self, prompt_ids: list[int], source: pb.KVSource, hold: Hold, stats: pb.KVTransfer) -> Hold:
        first, end = hold.num_blocks, source.lease.num_blocks
        if first >= end:
            return hold
        arrived = None
        if self.device is not None and source.lease.transfer_address:
            try:
                arrived = await self._pull_device(source, first, end)
                stats.transport = "device"
            except (grpc.aio.AioRpcError, TransferFailed, TimeoutError, jax.errors.JaxRuntimeError) as e:
                logger.warning("device KV pull from %s failed, pulling bytes: %s", source.address, _why(e))
        try:
            if arrived is None:
                arrived = await self._pull_bytes(source, first, end)
                stats.transport = "grpc"
        except (grpc.aio.AioRpcError, TransferFailed) as e:
            stats.error = f"pull failed: {_why(e)}"
            return hold
        longer = await self._holding(lambda r: arrived(r.replicas[0], hold, prompt_ids))
        if longer is None:
            stats.error = "the engine loop is not running"
            return hold
        stats.blocks_pulled = longer.num_blocks - first
        stats.bytes = stats.blocks_pulled * self.layout.block_bytes
        return longer

    async def _pull_bytes(self, source: pb.KVSource, first: int, end: int) -> WriteInto:
        """Blocks [first, end) of the lease as bytes; returns the write of them into the cache."""
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        expected = first
        call = self._peer(source.address).PullKV(
            pb.PullKVRequest(lease_id=source.lease.lease_id, first_block=first, num_blocks=end - first),
            timeout=PULL_TIMEOUT)
        async for msg in call:
            if msg.first_block != expected:
                raise TransferFailed(f"block {msg.first_block} arrived, {expected} expected")
            try:
                parts.append(self.layout.arrays(msg.k, msg.v, msg.num_blocks))
            except ValueError as e:
                raise TransferFailed(str(e)) from e
            expected += msg.num_blocks
        if expected != end:
            raise TransferFailed(f"the pull ended at block {expected} of {end}")
        k = np.concatenate([k for k, _ in parts], axis=2)
        v = np.concatenate([v for _, v in parts], axis=2)
        return lambda engine, hold, ids: write_blocks(engine, hold, ids, k, v)

    async def _pull_device(self, source: pb.KVSource, first: int, end: int) -> WriteInto:
        """Blocks [first, end) of the lease device to device; returns the write of them into the cache."""
        staged = await self._peer(source.address).StageKV(
            pb.PullKVRequest(lease_id=source.lease.lease_id, first_block=first, num_blocks=end - first),
            timeout=PULL_TIMEOUT)
        device = self.device
        if staged.chunk_blocks != device.chunk_shape[2] or staged.num_chunks * staged.chunk_blocks < end - first:
            raise TransferFailed(f"{staged.num_chunks} chunks of {staged.chunk_blocks} blocks staged, "
                                 f"{end - first} blocks of {device.chunk_shape[2]} a chunk wanted")
        arrays = await asyncio.to_thread(device.pull, source.lease.transfer_address, staged.transfer_id,
                                         2 * staged.num_chunks, PULL_TIMEOUT)
        return lambda engine, hold, ids: write_staged_blocks(engine, hold, ids, arrays, end - first)

    async def _ack(self, source: pb.KVSource) -> None:
        try:
            await self._peer(source.address).ReleaseLease(pb.ReleaseLeaseRequest(lease_id=source.lease.lease_id),
                                                          timeout=10.0)
        except grpc.aio.AioRpcError as e:  # the lease times out there instead
            logger.warning("releasing KV lease %d on %s failed: %s", source.lease.lease_id, source.address,
                           e.code().name)

    def _peer(self, address: str) -> WorkerStub:
        if address not in self._peers:
            channel = grpc.aio.insecure_channel(address, options=PEER_OPTIONS)
            self._peers[address] = (channel, WorkerStub(channel))
        return self._peers[address][1]

    def release_hold(self, hold: Hold | None) -> None:
        """Release a hold on the engine thread, in the background (safe in a cancelled task)."""
        if hold is not None:
            self._in_background(self._release(hold))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _holding(self, fn: Callable[[DataParallelRouter], Hold]) -> Hold | None:
        """fn(router) on the engine thread, returning a hold; if the caller is cancelled meanwhile,
        the hold is released when it comes."""
        task = asyncio.ensure_future(self._engine.between_steps(fn))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def drop(t: asyncio.Future) -> None:
                if not t.cancelled() and t.exception() is None:
                    self.release_hold(t.result())
            task.add_done_callback(drop)
            raise

    async def _release(self, hold: Hold) -> None:
        await self._engine.between_steps(lambda r: release(r.replicas[0], hold))


def _why(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error) or type(error).__name__
