"""The caches of a hybrid's layer groups: the Gated DeltaNet layers' fixed-size state per
sequence (`LinearStateCache`, indexed by state slot), and the model's caches together
(`ModelCaches`: one per layer group; the full-attention group's is the paged `KVCache`).

State slots are the KV layer's (`jaxserve.kv.state_slots`): a sequence holds one from admission
to its end; slot 0 is reserved, as block 0 is: padding sequences read and write it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.architectures.layer_groups import layer_groups
from checkpoints.config import ModelConfig
from jaxserve.model.kv_cache import KVCache

STATE_DTYPE = jnp.float32  # the states are sums over the whole sequence: kept in f32


def conv_channels(config: ModelConfig) -> int:
    """Channels of the Gated DeltaNet's conv: its queries, keys and values."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    return 2 * key + config.linear_num_value_heads * config.linear_value_head_dim


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LinearStateCache:
    """conv [L, slots, K - 1, C]: each sequence's last K - 1 conv inputs; recurrent
    [L, slots, H_v, d_k, d_v]: its delta-rule state; L = the Gated DeltaNet layers. `block_size`: the
    paged cache's (a padding row's KV slot is below it: `AttentionMetadata.real_rows`)."""

    conv: jax.Array
    recurrent: jax.Array
    block_size: int = dataclasses.field(default=16, metadata=dict(static=True))

    @classmethod
    def zeros(cls, config: ModelConfig, num_slots: int, block_size: int = 16) -> LinearStateCache:
        layers = sum(len(g.layers) for g in layer_groups(config) if g.name == "linear_layers")
        conv = (layers, num_slots, config.linear_conv_kernel_dim - 1, conv_channels(config))
        heads = config.linear_num_value_heads
        recurrent = (layers, num_slots, heads, config.linear_key_head_dim, config.linear_value_head_dim)
        return cls(jnp.zeros(conv, STATE_DTYPE), jnp.zeros(recurrent, STATE_DTYPE), block_size)

    @staticmethod
    def bytes_per_slot(config: ModelConfig) -> int:
        """Bytes of one sequence's state over all the Gated DeltaNet layers."""
        shapes = jax.eval_shape(lambda: LinearStateCache.zeros(config, 1))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelCaches:
    """A hybrid's caches, one per layer group (`layer_groups`): `paged` of its full-attention
    layers, `state` of its Gated DeltaNet layers."""

    paged: KVCache
    state: LinearStateCache

    @property
    def num_blocks(self) -> int:
        return self.paged.num_blocks

    @property
    def block_size(self) -> int:
        return self.paged.block_size


def paged_of(cache: KVCache | ModelCaches) -> KVCache:
    """The paged KV cache of a model's caches (all of them for a model of full attention only)."""
    return cache.paged if isinstance(cache, ModelCaches) else cache


def with_paged(cache: KVCache | ModelCaches, paged: KVCache) -> Any:
    """The model's caches with their paged KV cache replaced."""
    return dataclasses.replace(cache, paged=paged) if isinstance(cache, ModelCaches) else paged


def copy_states(caches: ModelCaches, src: jax.Array, dst: jax.Array) -> ModelCaches:
    """The caches with the states of state slots `dst[i]` set to those of `src[i]` (every Gated
    DeltaNet layer; a snapshot taken or restored). Padding moves slot 0 onto itself."""
    state = caches.state
    copied = dataclasses.replace(
        state,
        conv=state.conv.at[:, dst].set(state.conv[:, src]),
        recurrent=state.recurrent.at[:, dst].set(state.recurrent[:, src]),
    )
    return dataclasses.replace(caches, state=copied)
