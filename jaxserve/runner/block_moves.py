"""KV block moves planned by the KV manager: swap-out to and swap-in from the host tier; and reads
and writes of KV handed between engines (disaggregation).
Each runs as a small jitted gather / scatter of BLOCK_MOVE_CHUNK blocks (padding moves block 0,
which no sequence reads), one compiled shape each. Writes to the disk tier hand the blocks'
arrays (device ones still copying to the host) to `disk_sink`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxserve.kv import CopyKind, HostBlockArrays
from jaxserve.model import KVCache

BLOCK_MOVE_CHUNK = 32  # block moves are padded to this many (block 0 -> block 0)


def _gather(cache: KVCache, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    return cache.k[:, :, blocks], cache.v[:, :, blocks]


def _scatter(cache: KVCache, blocks: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    return KVCache(cache.k.at[:, :, blocks].set(k), cache.v.at[:, :, blocks].set(v))


class BlockMover:
    """Moves blocks of a runner's cache; holds the host tier's copies (on each process, the kv
    heads of its own devices' shards, so swapping works across hosts)."""

    def __init__(self, cache: KVCache, cache_sharding, replicated, num_host_blocks: int):
        layers, kv_heads, _, block_size, head_dim = cache.k.shape
        host_shape = (layers, kv_heads, max(num_host_blocks, 1), block_size, head_dim)
        self.dtype = cache.k.dtype
        self.host_k = HostBlockArrays.allocate(host_shape, self.dtype)
        self.host_v = HostBlockArrays.allocate(host_shape, self.dtype)
        self.cache_sharding = cache_sharding
        kv, rep = cache_sharding, replicated
        self._gather = jax.jit(_gather, in_shardings=(kv, rep), out_shardings=kv)
        self._scatter = jax.jit(_scatter, donate_argnums=(0,), in_shardings=(kv, rep, kv, kv), out_shardings=kv)
        # DiskTier.write(tickets, [k, v]) with block i on axis 2: set when the engine has a disk tier.
        self.disk_sink: Callable[[list[int], list], None] | None = None

    def warm_up(self, cache: KVCache) -> KVCache:
        """Compile the two moves (one shape each) by running them on block 0."""
        zeros = np.zeros(BLOCK_MOVE_CHUNK, np.int32)
        k, v = self._gather(cache, zeros)
        return self._scatter(cache, zeros, k, v)

    def move(self, cache: KVCache, kind: CopyKind, src: list[int], dst: list[int]) -> KVCache:
        """Move up to BLOCK_MOVE_CHUNK blocks; returns the cache (donated)."""
        if kind is CopyKind.DEVICE_TO_DISK:
            k, v = self._gather(cache, _padded(src))
            k.copy_to_host_async()
            v.copy_to_host_async()
            self.disk_sink(dst, [k, v])  # the writer thread waits for the copies, not this one
            return cache
        if kind is CopyKind.HOST_TO_DISK:
            self.disk_sink(dst, [self.host_k[:, :, src], self.host_v[:, :, src]])  # copies, taken now
            return cache
        if kind is CopyKind.DEVICE_TO_HOST:
            k, v = self._gather(cache, _padded(src))
            for host, blocks in ((self.host_k, k), (self.host_v, v)):
                for shard in blocks.addressable_shards:
                    host[shard.index][:, :, dst] = np.asarray(shard.data)[:, :, : len(src)]
            return cache
        return self.write(cache, dst, self.host_k[:, :, src], self.host_v[:, :, src])

    def gather(self, cache: KVCache, blocks: list[int]) -> tuple[jax.Array, jax.Array]:
        """K and V of up to BLOCK_MOVE_CHUNK device blocks as device arrays of BLOCK_MOVE_CHUNK
        blocks, block i on axis 2 (the rest padding: copies of block 0)."""
        return self._gather(cache, _padded(blocks))

    def scatter(self, cache: KVCache, blocks: list[int], k: jax.Array, v: jax.Array) -> KVCache:
        """Write `gather`'s arrays (from this engine or another with the same layout) into up to
        BLOCK_MOVE_CHUNK device blocks; the padding lands in block 0. Returns the cache (donated)."""
        return self._scatter(cache, _padded(blocks), k, v)

    def read(self, cache: KVCache, blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """K and V of up to BLOCK_MOVE_CHUNK device blocks as host arrays, block i on axis 2 (KV
        handed to another engine)."""
        k, v = self.gather(cache, blocks)
        return np.asarray(k)[:, :, : len(blocks)], np.asarray(v)[:, :, : len(blocks)]

    def write(self, cache: KVCache, blocks: list[int], k: np.ndarray, v: np.ndarray) -> KVCache:
        """Write host K and V (block i on axis 2) into up to BLOCK_MOVE_CHUNK device blocks;
        returns the cache (donated)."""
        shape = self.host_k.shape[:2] + (BLOCK_MOVE_CHUNK,) + self.host_k.shape[3:]
        arrays = []
        for data in (k, v):
            chunk = np.zeros(shape, self.dtype)
            chunk[:, :, : len(blocks)] = data
            arrays.append(jax.make_array_from_callback(shape, self.cache_sharding, chunk.__getitem__))
        return self.scatter(cache, blocks, *arrays)


def padded_moves(src: list[int], dst: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Up to BLOCK_MOVE_CHUNK moves `dst[i] <- src[i]` padded with 0 -> 0 (one compiled shape)."""
    return _padded(src), _padded(dst)


def _padded(ids: list[int]) -> np.ndarray:
    out = np.zeros(BLOCK_MOVE_CHUNK, np.int32)
    out[: len(ids)] = ids
    return out
