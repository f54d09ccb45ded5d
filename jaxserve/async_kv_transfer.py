"""KV export and import (`KVTransferEngine`) of the async engine, on its one replica: each call
runs on the engine thread between steps, through the replica's `EngineCore` methods."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxserve import kv_transfer
from jaxserve.engine_client import BlockLayout, EngineInfo, KVEventSource, KVHold, StagedKV, TransferError
from jaxserve.engine_core import EngineCore

if TYPE_CHECKING:
    from jaxserve.data_parallel import DataParallelEngine


class AsyncKVTransfer:
    """The `KVTransferEngine` methods of `AsyncEngine` (which supplies the engine and
    `_on_engine_thread`)."""

    info: EngineInfo
    engine: DataParallelEngine
    _transfer: kv_transfer.DeviceTransfer | None
    _kv_fingerprint: bytes | None
    _on_engine_thread: Callable[[Callable[[DataParallelEngine], Any]], Awaitable[Any]]

    @property
    def _replica(self) -> EngineCore:
        return self.engine.lone_replica

    async def _on_replica_thread(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(the one replica) on the engine thread between steps."""
        return await self._on_engine_thread(lambda e: fn(e.lone_replica))

    @property
    def kv_layout(self) -> BlockLayout:
        return self._replica.kv_block_layout()

    def kv_key(self, token_ids: Sequence[int], num_blocks: int) -> bytes:
        if self._kv_fingerprint is None:
            self._kv_fingerprint = self._replica.kv_handoff_fingerprint()
        return kv_transfer.prompt_key(self._kv_fingerprint, token_ids, num_blocks, self.info.block_size)

    def start_transfer_server(self, host: str) -> str:
        """Serve device-to-device KV pulls on `host` (an address other workers reach); returns
        the server's address. ValueError for uneven pipeline stages (they hand KV over as bytes)."""
        self._transfer = self._replica.start_device_transfer(host)
        return self._transfer.address

    @property
    def transfer_address(self) -> str | None:
        return self._transfer.address if self._transfer is not None else None

    def kv_events(self) -> KVEventSource | None:
        return self._replica.kv_event_log()

    def lora_adapter_digests(self) -> dict[str, bytes]:
        return self._replica.lora_adapter_digests()

    async def hold_kv(self, token_ids: Sequence[int], max_blocks: int | None = None) -> KVHold | None:
        return await self._on_replica_thread(lambda r: r.hold_prefix(token_ids, max_blocks))

    async def read_kv(self, hold: KVHold, first: int, count: int) -> tuple[np.ndarray, np.ndarray] | None:
        return await self._on_replica_thread(lambda r: r.read_kv_blocks(hold, first, count))

    async def write_kv(self, hold: KVHold, token_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> KVHold | None:
        return await self._on_replica_thread(lambda r: r.write_kv_blocks(hold, token_ids, k, v))

    async def stage_kv(self, hold: KVHold, first: int, count: int, timeout: float) -> StagedKV | None:
        transfer = self._transfer
        if transfer is None:
            raise LookupError("this worker moves KV as bytes only (--kv-transport grpc)")

        def offer(replica: EngineCore) -> StagedKV:
            arrays = replica.stage_kv_blocks(hold, first, count)
            return StagedKV(
                transfer.address, transfer.offer(arrays, timeout), count, len(arrays) // 2, transfer.chunk_shape[2]
            )

        return await self._on_replica_thread(offer)

    async def pull_staged_kv(
        self, staged: StagedKV, hold: KVHold, token_ids: Sequence[int], timeout: float
    ) -> KVHold | None:
        transfer = self._transfer
        if transfer is None:
            raise TransferError("this worker has no transfer server")
        chunk = transfer.chunk_shape[2]
        if staged.chunk_blocks != chunk or staged.num_chunks * chunk < staged.num_blocks:
            raise TransferError(
                f"{staged.num_chunks} chunks of {staged.chunk_blocks} blocks staged, "
                f"{staged.num_blocks} blocks of {chunk} a chunk wanted"
            )
        try:
            arrays = await asyncio.to_thread(
                transfer.pull, staged.address, staged.transfer_id, 2 * staged.num_chunks, timeout
            )
        except (TimeoutError, jax.errors.JaxRuntimeError) as e:
            raise TransferError(str(e) or type(e).__name__) from e
        return await self._on_replica_thread(
            lambda r: r.write_staged_kv_blocks(hold, token_ids, arrays, staged.num_blocks)
        )

    async def release_kv(self, hold: KVHold) -> None:
        await self._on_replica_thread(lambda r: r.release_hold(hold))
