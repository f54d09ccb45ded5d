"""The paged KV cache and where a step's tokens go in it (the metadata every attention reads)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.config import ModelConfig
from kernels_pallas import kv_quant


def cache_heads(config: ModelConfig) -> tuple[int, int]:
    """(heads, values per row) of each of K and V. Multi-head latent attention caches one latent
    per token, [c_kv | k_pe] (kv_lora_rank + qk_rope_head_dim values, no heads), stored as one head
    in two halves, K and V (`kernels_pallas.mla_reference.split_latent`): blocks keep the one K/V
    shape that every block move (tiers, swap, handoff, pool) is written for, and count the
    latent's real bytes."""
    if config.is_mla:
        return 1, (config.kv_lora_rank + config.qk_rope_head_dim) // 2
    return config.num_kv_heads, config.head_dim


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Stacked paged cache: k and v are [num_layers, num_kv_heads, num_blocks, block_size, row], a
    row being head_dim values of the storage dtype, and a scale for int8 / fp8 (`kernels_pallas.kv_quant`);
    for multi-head latent attention, one head of half a latent each (`cache_heads`)."""

    k: jax.Array
    v: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @classmethod
    def zeros(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: Any) -> KVCache:
        heads, width = cache_heads(config)
        shape = (config.num_layers, heads, num_blocks, block_size, kv_quant.row_width(width, dtype))
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: Any) -> int:
        """Bytes of K and V of one block in a cache of storage dtype `dtype`, scales included."""
        heads, width = cache_heads(config)
        per_token = 2 * config.num_layers * heads * kv_quant.row_width(width, dtype)
        return per_token * block_size * jnp.dtype(dtype).itemsize

    def write(self, layer: jax.Array, kv_slots: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """The cache with layer `layer`'s K and V [T, num_kv_heads, head_dim] of a step's new tokens
        stored (in the storage format) at their KV slots [T]: an in-place scatter where the cache is
        a scan's carry or donated."""
        blocks, offsets = kv_slots // self.block_size, kv_slots % self.block_size
        return KVCache(
            self.k.at[layer, :, blocks, offsets].set(kv_quant.quantize(k, self.k.dtype)),
            self.v.at[layer, :, blocks, offsets].set(kv_quant.quantize(v, self.v.dtype)),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where a step's new tokens go and what each sequence attends to.

    kv_slots [T]: KV slot (block * block_size + offset) of each new token; padding rows
      point into block 0, which is never allocated.
    block_tables [S, W], seq_lens [S]: each sequence's blocks and its length after this step.
    query_start [P + 1]: row offsets of the new tokens of the first P sequences (ragged
      prefill chunks); None for a decode step, where row b is the one new token of sequence b.
    decode_rows [S - P]: a prefill step that runs decodes too (in one program): the row of
      each of the last S - P sequences' one new token (decodes), after the chunks' rows; a
      padding entry is T (out of range) and its sequence's length 0. None: no decodes.
    lora_slots [T]: with LoRA on, each row's LoRA slot (-1: the base model; see
      jaxserve/model/lora.py). None: LoRA off.
    visible_until [T]: a vision-language model's prefill step, the last position each row
      attends to: its own for text, its image's last for an image's soft tokens (Gemma 3 attends
      both ways within an image). None: causal.
    state_slots [S]: a hybrid's (Gated DeltaNet layers), each sequence's state slot
      (`jaxserve.model.state_cache`; 0 for padding). None: no linear-attention layers.
    """

    kv_slots: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start: jax.Array | None = None
    decode_rows: jax.Array | None = None
    lora_slots: jax.Array | None = None
    visible_until: jax.Array | None = None
    state_slots: jax.Array | None = None

    def real_rows(self, block_size: int) -> jax.Array:
        """[T] bool: the rows of live tokens (a padding row's KV slot is in block 0, never allocated)."""
        return self.kv_slots >= block_size
