"""KV handed between engines (prefill/decode disaggregation): the engine side, run on the engine
thread between steps.

The prefill engine holds a prompt's cached blocks when its sequence ends (`EngineCore.hold_prefix`)
and reads them out in chunks (`read_blocks`); the decode engine holds what its cache has of the
prompt (`hold_prefix` again), writes the pulled rest into fresh blocks, adds them to its prefix
cache (`write_blocks`), and keeps them held until the request is admitted, which then takes them
as a prefix hit and computes only the partial last block. Both sides key the blocks by content
(`prompt_key`: chained hashes of the tokens seeded with `kv_fingerprint`, the disk tier's keys),
so bytes from an engine with other weights, dtype or layout are never used.

The blocks move either as host bytes (`read_blocks` / `write_blocks`, the portable path) or
device to device (`stage_blocks` / `write_staged_blocks` over a `DeviceTransfer`: the source
offers device arrays that the other engine's transfer server pulls straight into its devices,
through `jax.experimental.transfer`). (Here, not in jaxserve/kv, because it moves device arrays.)

These functions are the engine's own (`jaxserve.engine_core_ops` passes them its runner and KV
manager); everything above an engine moves blocks through `EngineCore`'s methods.
"""

from __future__ import annotations

import datetime
import itertools
import random
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import transfer

from jaxserve.engine_client import BlockLayout
from jaxserve.kv import Hold, KVCacheManager
from jaxserve.kv.content_keys import chain_keys
from jaxserve.runner import ModelRunner
from jaxserve.runner.block_moves import BLOCK_MOVE_CHUNK
from sharding.pipeline import pad_layers


def block_layout(runner: ModelRunner) -> BlockLayout:
    """A block as the handoff moves it: [model layers, kv heads, block size, head dim] (uneven
    pipeline stages' identity layers are not sent). A hybrid's is refused: its linear-attention
    state (`ModelCaches.state`) is not handed off yet."""
    if runner.engine_config.num_state_slots:
        raise ValueError("KV handoff of a Gated DeltaNet hybrid model (its per-sequence state) is not supported yet")
    host = runner.blocks.host_k  # [served layers, kv_heads, host slots, block_size, head_dim]
    stages = runner.stages
    layers = host.shape[0] if stages is None else stages.num_layers
    return BlockLayout((layers, host.shape[1], *host.shape[3:]), host.dtype)


def prompt_key(fingerprint: bytes, token_ids: Sequence[int], num_blocks: int, block_size: int) -> bytes:
    """Content key of the prompt's block `num_blocks - 1` (it chains all before it)."""
    return chain_keys(fingerprint, token_ids, num_blocks, block_size)[-1] if num_blocks else fingerprint


def _check_held(hold: Hold, first: int, count: int) -> None:
    if not hold.active:
        raise LookupError("the hold was released")
    if not 0 <= first <= first + count <= hold.num_blocks:
        raise ValueError(f"blocks [{first}, {first + count}) are not held (the hold has {hold.num_blocks})")


def read_blocks(runner: ModelRunner, hold: Hold, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of held blocks [first, first + count), block i on axis 2."""
    _check_held(hold, first, count)
    blocks = hold.blocks[first : first + count]
    parts = [
        runner.blocks.read(runner.cache, blocks[i : i + BLOCK_MOVE_CHUNK])
        for i in range(0, len(blocks), BLOCK_MOVE_CHUNK)
    ]
    k, v = (np.concatenate([part[j] for part in parts], axis=2) for j in (0, 1))
    if runner.stages is not None and runner.stages.is_uneven:  # the model's layers, in order
        real = np.flatnonzero(runner.stages.padded_index >= 0)
        k, v = k[real], v[real]
    return k, v


def write_blocks(
    runner: ModelRunner, kv: KVCacheManager, hold: Hold, token_ids: Sequence[int], k: np.ndarray, v: np.ndarray
) -> Hold:
    """Write pulled K and V of the prompt's blocks from `hold.num_blocks` on into fresh blocks
    and add them to the prefix cache; returns the hold of the longer path (it replaces `hold`).
    Fewer blocks are taken when the pool is short (the request recomputes the rest)."""
    stages = runner.stages
    if stages is not None:  # into this engine's stage layers (identity layers: zeros, never read)
        k, v = pad_layers(k, stages), pad_layers(v, stages)

    def write(cache, blocks: list[int], first: int):
        part = slice(first, first + len(blocks))
        return runner.blocks.write(cache, blocks, k[:, :, part], v[:, :, part])

    return _write_imported(runner, kv, hold, token_ids, k.shape[2], write)


def stage_blocks(runner: ModelRunner, hold: Hold, first: int, count: int) -> list[jax.Array]:
    """K and V of held blocks [first, first + count) as device arrays K0, V0, K1, V1, ...: chunk i
    holds BLOCK_MOVE_CHUNK blocks from first + i * BLOCK_MOVE_CHUNK on (the last one padded)."""
    _check_held(hold, first, count)
    check_device_layout(runner)
    blocks = hold.blocks[first : first + count]
    return [
        x
        for i in range(0, len(blocks), BLOCK_MOVE_CHUNK)
        for x in runner.blocks.gather(runner.cache, blocks[i : i + BLOCK_MOVE_CHUNK])
    ]


def write_staged_blocks(
    runner: ModelRunner,
    kv: KVCacheManager,
    hold: Hold,
    token_ids: Sequence[int],
    arrays: list[jax.Array],
    num_blocks: int,
) -> Hold:
    """`write_blocks` for `stage_blocks`' arrays, pulled onto this engine's devices."""
    check_device_layout(runner)

    def write(cache, blocks: list[int], first: int):
        chunk = 2 * (first // BLOCK_MOVE_CHUNK)
        return runner.blocks.scatter(cache, blocks, arrays[chunk], arrays[chunk + 1])

    return _write_imported(runner, kv, hold, token_ids, num_blocks, write)


def check_device_layout(runner: ModelRunner) -> None:
    """Staged arrays carry the cache's own layer positions: engines with uneven pipeline stages
    (identity layers among them) hand blocks over as bytes only."""
    if runner.stages is not None and runner.stages.is_uneven:
        raise ValueError(f"uneven pipeline stages ({runner.stages.describe()}) move KV as bytes, not device to device")


def _write_imported(
    runner: ModelRunner,
    kv: KVCacheManager,
    hold: Hold,
    token_ids: Sequence[int],
    num_blocks: int,
    write: Callable[..., object],
) -> Hold:
    """Allocate up to `num_blocks` fresh blocks, fill them chunk by chunk (`write(cache, blocks,
    first)` for the blocks from `first` on) and add them to the prefix cache after `hold`."""
    blocks = kv.allocate_import(num_blocks)
    runner.move_blocks(kv.take_copies())  # evictions for them plan copies that read the old contents
    for i in range(0, len(blocks), BLOCK_MOVE_CHUNK):
        runner.write_blocks(write, blocks[i : i + BLOCK_MOVE_CHUNK], i)
    return kv.leases.adopt_import(hold, token_ids, blocks)


class DeviceTransfer:
    """This engine's `jax.experimental.transfer` server: offers staged arrays for one pull each
    and pulls other engines' offers onto this engine's devices.

    A pull of an id the source does not (or no longer) offers waits until the source closes the
    connection, so each pull runs on a daemon thread that the caller stops waiting for after its
    timeout; offers not pulled within `offer_timeout` seconds are dropped by the source."""

    def __init__(self, runner: ModelRunner, host: str) -> None:
        self.sharding = runner.blocks.cache_sharding
        client = next(iter(runner.cache.k.sharding.device_set)).client
        bind = f"[{host}]:0" if ":" in host else f"{host}:0"
        self._server = transfer.start_transfer_server(client, bind, [bind])
        self.address = self._server.address()
        block = block_layout(runner).shape
        self.chunk_shape = block[:2] + (BLOCK_MOVE_CHUNK,) + block[2:]
        self.dtype = runner.cache.k.dtype
        self._ids = itertools.count(random.getrandbits(48) + 1)  # unique across restarts too
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()

    def offer(self, arrays: list[jax.Array], offer_timeout: float) -> int:
        transfer_id = next(self._ids)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=offer_timeout)
        self._server.await_pull(transfer_id, arrays, timeout=deadline)
        return transfer_id

    def pull(self, address: str, transfer_id: int, num_arrays: int, timeout: float) -> list[jax.Array]:
        """The offered arrays, on this engine's devices (laid out as its cache); TimeoutError after
        `timeout` seconds, a JaxRuntimeError when the source fails."""
        spec = jax.ShapeDtypeStruct(self.chunk_shape, self.dtype, sharding=self.sharding)
        done = threading.Event()
        result: list = []

        def run() -> None:
            try:
                arrays = self._connection(address).pull(transfer_id, [spec] * num_arrays)
                result.append(jax.block_until_ready(arrays))
            except Exception as e:  # noqa: BLE001 - handed to the waiting caller
                result.append(e)
            done.set()

        threading.Thread(target=run, name="kv-device-pull", daemon=True).start()
        if not done.wait(timeout):
            with self._lock:  # a connection that hangs is not reused
                self._connections.pop(address, None)
            raise TimeoutError(f"the device pull from {address} took over {timeout:.0f} s")
        if isinstance(result[0], Exception):
            with self._lock:
                self._connections.pop(address, None)
            raise result[0]
        return list(result[0])

    def _connection(self, address: str):
        with self._lock:
            if address not in self._connections:
                self._connections[address] = self._server.connect(address)
            return self._connections[address]
