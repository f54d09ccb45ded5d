"""KV handed between engines (prefill/decode disaggregation): the engine side, run on the engine
thread between steps.

The prefill engine holds a prompt's cached blocks when its sequence ends (`hold_prompt`) and
reads them out in chunks (`read_blocks`); the decode engine holds what its cache has of the
prompt (`hold_prompt` again), writes the pulled rest into fresh blocks, adds them to its prefix
cache (`write_blocks`), and keeps them held until the request is admitted, which then takes them
as a prefix hit and computes only the partial last block. Both sides key the blocks by content
(`prompt_key`: chained hashes of the tokens seeded with `kv_fingerprint`, the disk tier's keys),
so bytes from an engine with other weights, dtype or layout are never used.
(Here, not in jaxserve/kv, because it moves device arrays.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.kv import Hold
from jaxserve.kv.content_keys import chain_keys
from jaxserve.runner.block_moves import BLOCK_MOVE_CHUNK

if TYPE_CHECKING:
    from jaxserve.engine import LLMEngine


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """One block's K (or V) array: [layers, kv_heads, block_size, head_dim] of `dtype`."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def block_bytes(self) -> int:
        """K and V of one block."""
        return 2 * int(np.prod(self.shape)) * self.dtype.itemsize

    def arrays(self, k: bytes, v: bytes, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of `num_blocks` blocks from their bytes (block i on axis 2); ValueError when
        the sizes do not fit."""
        layers, heads, bs, dim = self.shape
        shape = (layers, heads, num_blocks, bs, dim)
        want = self.block_bytes // 2 * num_blocks
        if len(k) != want or len(v) != want:
            raise ValueError(f"{num_blocks} blocks need {want} bytes each of K and V, got {len(k)} and {len(v)}")
        return np.frombuffer(k, self.dtype).reshape(shape), np.frombuffer(v, self.dtype).reshape(shape)


def block_layout(engine: LLMEngine) -> BlockLayout:
    host = engine.runner.blocks.host_k  # [layers, kv_heads, slots, block_size, head_dim]
    return BlockLayout(host.shape[:2] + host.shape[3:], host.dtype)


def prompt_key(fingerprint: bytes, token_ids: Sequence[int], num_blocks: int, block_size: int) -> bytes:
    """Content key of the prompt's block `num_blocks - 1` (it chains all before it)."""
    return chain_keys(fingerprint, token_ids, num_blocks, block_size)[-1] if num_blocks else fingerprint


def hold_prompt(engine: LLMEngine, token_ids: Sequence[int], max_blocks: int | None = None) -> Hold:
    return engine.kv.hold_prefix(token_ids, max_blocks)


def release(engine: LLMEngine, hold: Hold) -> None:
    if hold.active:
        engine.kv.release_hold(hold)


def read_blocks(engine: LLMEngine, hold: Hold, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of held blocks [first, first + count), block i on axis 2."""
    if not hold.active or not 0 <= first <= first + count <= hold.num_blocks:
        raise ValueError(f"blocks [{first}, {first + count}) are not held (the hold has {hold.num_blocks})")
    runner, blocks = engine.runner, hold.blocks[first:first + count]
    parts = [runner.blocks.read(runner.cache, blocks[i:i + BLOCK_MOVE_CHUNK])
             for i in range(0, len(blocks), BLOCK_MOVE_CHUNK)]
    return np.concatenate([k for k, _ in parts], axis=2), np.concatenate([v for _, v in parts], axis=2)


def write_blocks(engine: LLMEngine, hold: Hold, token_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> Hold:
    """Write pulled K and V of the prompt's blocks from `hold.num_blocks` on into fresh blocks
    and add them to the prefix cache; returns the hold of the longer path (it replaces `hold`).
    Fewer blocks are taken when the pool is short (the request recomputes the rest)."""
    kv, runner = engine.kv, engine.runner
    blocks = kv.allocate_import(k.shape[2])
    runner.move_blocks(kv.take_copies())  # evictions for them plan copies that read the old contents
    k, v = k[:, :, :len(blocks)], v[:, :, :len(blocks)]
    for i in range(0, len(blocks), BLOCK_MOVE_CHUNK):
        part = slice(i, i + BLOCK_MOVE_CHUNK)
        runner.cache = runner.blocks.write(runner.cache, blocks[part], k[:, :, part], v[:, :, part])
    return kv.adopt_import(hold, token_ids, blocks)
