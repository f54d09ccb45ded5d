"""A worker's side of prefill/decode disaggregation: leases on a prefill worker, pulls on a decode one.

Prefill: a `hold_kv` request runs as any other (the router asks for one token); when it ends by
length, the engine holds the prompt's full cached blocks at once (before a later step could evict
them) and hands the hold over in the final delta, which becomes a lease that the last message
carries. A decode
worker pulls the blocks with `PullKV` and releases the lease (the ack); an Abort of the request
or the lease's timeout releases it too, so a decode worker that never comes leaks nothing.

Decode: before a `kv_source` request is admitted, the blocks its prefix cache holds of the prompt
are held and skipped, the rest pulled from the prefill worker, written into fresh blocks and
added to the cache (the engine's `KVTransferEngine` methods); the lease is released, and the request is admitted
as usual: a prefix hit up to the last full block, the partial block and the first output token
recomputed. A pull that fails leaves the request to recompute what did not arrive.

Transport: bytes over `PullKV` (gRPC), or, where both workers run with `--kv-transport device`,
device to device: the decode worker asks the prefill worker to stage the blocks (`StageKV`) and
pulls them from the transfer server its lease names (`KVTransferEngine.pull_staged_kv`); if that
fails it falls back to `PullKV`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any

import grpc
import numpy as np

from jaxserve.engine_client import KVHold, KVTransferEngine, StagedKV, TransferError
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.worker_pb2_grpc import WorkerStub
from server.tls import ClusterTLS, open_channel

logger = logging.getLogger(__name__)

READ_BLOCKS = 32  # blocks read out per call on the engine thread
MAX_MESSAGE_BYTES = 8 << 20  # K and V bytes in one KVBlocks message
PEER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES + (1 << 20))]
PULL_TIMEOUT = 120.0  # seconds a pull may take
STAGE_TIMEOUT = 30.0  # seconds staged device arrays wait for their pull
SWEEP_INTERVAL = 0.2  # seconds between checks for leases past their timeout


class LeaseGoneError(LookupError):
    """The lease was released (ack, abort or timeout) before the blocks were read."""


@dataclasses.dataclass(eq=False)
class Lease:
    lease_id: int
    request_id: str
    hold: KVHold
    key: bytes
    expires_at: float


class LeaseTable:
    """Leases by id; filled on the engine thread, read and emptied on the event loop (locked)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)

    def add(self, request_id: str, hold: KVHold, key: bytes) -> Lease:
        with self._lock:
            lease = Lease(next(self._ids), request_id, hold, key, time.monotonic() + self.timeout)
            self._leases[lease.lease_id] = lease
            return lease

    def get(self, lease_id: int) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

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
    def __init__(self, engine: KVTransferEngine, lease_timeout: float, tls: ClusterTLS | None = None) -> None:
        """Blocks move device to device where this engine has a transfer server
        (`engine.transfer_address`) and the other side has one too; else as bytes. `tls`: the
        channels to prefill workers use mutual TLS."""
        self._engine = engine
        self._tls = tls
        self.layout = engine.kv_layout
        self.block_size = engine.info.block_size
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

    def lease(self, request_id: str, prompt_ids: list[int], hold: KVHold) -> pb.KVLease:
        """Lease the blocks the engine held as the request ended (its final delta's `kv_hold`)."""
        key = self._engine.kv_key(prompt_ids, hold.num_blocks)
        lease = self.leases.add(request_id, hold, key)
        return pb.KVLease(
            lease_id=lease.lease_id,
            num_blocks=hold.num_blocks,
            last_key=key,
            timeout_s=self.leases.timeout,
            transfer_address=self._engine.transfer_address or "",
        )

    def _leased_range(self, request: pb.PullKVRequest) -> tuple[Lease, int, int]:
        lease = self.leases.get(request.lease_id)
        if lease is None:
            raise LeaseGoneError(f"no lease {request.lease_id} (released or timed out)")
        first, end = request.first_block, request.first_block + request.num_blocks
        if end > lease.hold.num_blocks:
            raise ValueError(f"blocks [{first}, {end}) asked for, the lease holds {lease.hold.num_blocks}")
        return lease, first, end

    async def read(self, request: pb.PullKVRequest) -> AsyncIterator[pb.KVBlocks]:
        """The leased blocks asked for, K and V bytes, at most MAX_MESSAGE_BYTES a message.
        LeaseGoneError when the lease is not (or no longer) held; ValueError for a bad range."""
        lease, first, end = self._leased_range(request)
        per_message = max(1, MAX_MESSAGE_BYTES // self.layout.block_bytes)
        for start in range(first, end, READ_BLOCKS):
            count = min(READ_BLOCKS, end - start)
            try:
                arrays = await self._engine.read_kv(lease.hold, start, count)
            except LookupError as e:  # released during the pull
                raise LeaseGoneError(f"lease {request.lease_id} was released during the pull") from e
            if arrays is None:
                raise LeaseGoneError("the engine loop is not running")
            k, v = arrays
            for j in range(0, count, per_message):
                part = slice(j, j + per_message)
                yield pb.KVBlocks(
                    first_block=start + j,
                    num_blocks=k[:, :, part].shape[2],
                    k=k[:, :, part].tobytes(),
                    v=v[:, :, part].tobytes(),
                )

    async def stage(self, request: pb.PullKVRequest) -> pb.StageKVResponse:
        """Offer the leased blocks asked for to one device-to-device pull (for STAGE_TIMEOUT
        seconds). LookupError when this worker has no transfer server or the lease is gone,
        ValueError for a bad range."""
        lease, first, end = self._leased_range(request)
        staged = await self._engine.stage_kv(lease.hold, first, end - first, STAGE_TIMEOUT)
        if staged is None:
            raise LeaseGoneError("the engine loop is not running")
        return pb.StageKVResponse(
            transfer_id=staged.transfer_id, num_chunks=staged.num_chunks, chunk_blocks=staged.chunk_blocks
        )

    async def release_lease(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id)
        if lease is not None:
            await self._engine.release_kv(lease.hold)
        return lease is not None

    async def abort(self, request_id: str) -> None:
        for lease in self.leases.pop_request(request_id):
            await self._engine.release_kv(lease.hold)

    def drop_leases(self, request_id: str) -> None:
        """`abort`'s releases in the background (safe in a cancelled task)."""
        for lease in self.leases.pop_request(request_id):
            self.release_hold(lease.hold)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            for lease in self.leases.pop_expired(time.monotonic()):
                logger.warning("KV lease %d of request %s timed out unpulled", lease.lease_id, lease.request_id)
                await self._engine.release_kv(lease.hold)

    # ----- decode side -----------------------------------------------------------------------

    async def pull_into_cache(self, prompt_ids: list[int], source: pb.KVSource) -> tuple[KVHold | None, pb.KVTransfer]:
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
            elif self._engine.kv_key(prompt_ids, lease.num_blocks) != lease.last_key:
                stats.error = (
                    "the prefill worker's KV does not fit here (other tokens, weights, dtype, KV cache dtype "
                    "(--kv-cache-dtype) or layout): recomputing"
                )
            else:
                hold = await self._holding(self._engine.hold_kv(prompt_ids, lease.num_blocks))
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

    async def _pull(self, prompt_ids: list[int], source: pb.KVSource, hold: KVHold, stats: pb.KVTransfer) -> KVHold:
        first, end = hold.num_blocks, source.lease.num_blocks
        if first >= end:
            return hold
        ids = prompt_ids[: end * self.block_size]
        longer = None
        if self._engine.transfer_address is not None and source.lease.transfer_address:
            try:
                longer = await self._holding(self._pull_device(source, first, end, hold, ids))
                stats.transport = "device"
            except (grpc.aio.AioRpcError, TransferError) as e:
                logger.warning("device KV pull from %s failed, pulling bytes: %s", source.address, _why(e))
        if longer is None:
            try:
                k, v = await self._pull_bytes(source, first, end)
            except (grpc.aio.AioRpcError, TransferError) as e:
                stats.error = f"pull failed: {_why(e)}"
                return hold
            longer = await self._holding(self._engine.write_kv(hold, ids, k, v))
            stats.transport = "grpc"
        if longer is None:
            stats.error = "the engine loop is not running"
            return hold
        stats.blocks_pulled = longer.num_blocks - first
        stats.bytes = stats.blocks_pulled * self.layout.block_bytes
        return longer

    async def _pull_bytes(self, source: pb.KVSource, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of blocks [first, end) of the lease, as bytes over `PullKV`."""
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        expected = first
        call = self._peer(source.address).PullKV(
            pb.PullKVRequest(lease_id=source.lease.lease_id, first_block=first, num_blocks=end - first),
            timeout=PULL_TIMEOUT,
        )
        async for msg in call:
            if msg.first_block != expected:
                raise TransferError(f"block {msg.first_block} arrived, {expected} expected")
            try:
                parts.append(self.layout.arrays(msg.k, msg.v, msg.num_blocks))
            except ValueError as e:
                raise TransferError(str(e)) from e
            expected += msg.num_blocks
        if expected != end:
            raise TransferError(f"the pull ended at block {expected} of {end}")
        return np.concatenate([k for k, _ in parts], axis=2), np.concatenate([v for _, v in parts], axis=2)

    async def _pull_device(
        self, source: pb.KVSource, first: int, end: int, hold: KVHold, prompt_ids: list[int]
    ) -> KVHold | None:
        """Blocks [first, end) of the lease device to device, written into the cache."""
        staged = await self._peer(source.address).StageKV(
            pb.PullKVRequest(lease_id=source.lease.lease_id, first_block=first, num_blocks=end - first),
            timeout=PULL_TIMEOUT,
        )
        offer = StagedKV(
            source.lease.transfer_address, staged.transfer_id, end - first, staged.num_chunks, staged.chunk_blocks
        )
        return await self._engine.pull_staged_kv(offer, hold, prompt_ids, PULL_TIMEOUT)

    async def _ack(self, source: pb.KVSource) -> None:
        try:
            await self._peer(source.address).ReleaseLease(
                pb.ReleaseLeaseRequest(lease_id=source.lease.lease_id), timeout=10.0
            )
        except grpc.aio.AioRpcError as e:  # the lease times out there instead
            logger.warning(
                "releasing KV lease %d on %s failed: %s", source.lease.lease_id, source.address, e.code().name
            )

    def _peer(self, address: str) -> WorkerStub:
        if address not in self._peers:
            channel = open_channel(address, self._tls, PEER_OPTIONS)
            self._peers[address] = (channel, WorkerStub(channel))
        return self._peers[address][1]

    def release_hold(self, hold: KVHold | None) -> None:
        """Release a hold on the engine thread, in the background (safe in a cancelled task)."""
        if hold is not None:
            self._in_background(self._engine.release_kv(hold))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _holding(self, work: Awaitable[KVHold | None]) -> KVHold | None:
        """Await engine work that returns a hold; if the caller is cancelled meanwhile, the hold is
        released when it comes."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:

            def drop(t: asyncio.Future) -> None:
                if not t.cancelled() and t.exception() is None:
                    self.release_hold(t.result())

            task.add_done_callback(drop)
            raise


def _why(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return str(error) or type(error).__name__
