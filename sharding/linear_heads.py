"""Tensor parallelism of a hybrid's Gated DeltaNet layers: split by heads over `tp`.

The block's projections give per-head outputs (z, b, a by value head; Qwen3-Next's fused
`in_proj_qkvz` and `in_proj_ba` grouped by key head), and each key head serves H_v / H_k
consecutive value heads, so a contiguous split over `tp` (`sharding.rules`: the `linear_heads`
axis) gives each device whole key heads with their value heads. The exception is the conv's
channels in checkpoints' order: all queries, then all keys, then all values (Qwen3.5's
`in_proj_qkv` outputs, both families' conv taps). `shard_linear_channels` reorders them into `tp`
groups, each the queries, keys and values of one shard's key heads, so the contiguous split keeps
every head's channels on its device; the model reads that order from `ModelConfig.linear_shards`.
The states split with the heads: the conv state over its channels, the recurrent state over its
value heads (`state_sharding`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoints.config import ModelConfig
from sharding.rules import TP

# The leaves whose conv channels are reordered, and the axis of their channels.
_CHANNEL_AXES = {"linear_layers/in_proj_qkv/kernel": -1, "linear_layers/gated_delta/conv1d": 1}


def plan_linear_heads(config: ModelConfig, tp: int) -> None:
    """Raise ValueError unless `tp` divides the Gated DeltaNet's key heads (and so its value heads)."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    if hk % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's {hk} Gated DeltaNet key heads ({hv} value heads)"
        )


def channel_order(config: ModelConfig, shards: int) -> np.ndarray:
    """The checkpoint's conv channels in the order of `shards` groups of [queries, keys, values]."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    value = config.linear_num_value_heads * config.linear_value_head_dim
    queries = np.arange(key).reshape(shards, -1)
    values = 2 * key + np.arange(value).reshape(shards, -1)
    return np.concatenate([queries, key + queries, values], axis=1).reshape(-1)


def shard_linear_channels(params: dict[str, Any], config: ModelConfig, shards: int) -> dict[str, Any]:
    """A parameter tree whose conv channels are in the order of `shards` groups (numpy leaves stay
    numpy, jax leaves jax); the tree itself for one shard, whose order is the checkpoint's."""
    if shards == 1:
        return params
    order = channel_order(config, shards)

    def reorder(keys: tuple, leaf: Any) -> Any:
        axis = _CHANNEL_AXES.get("/".join(str(k.key) for k in keys))
        if axis is None:
            return leaf
        xp = jnp if isinstance(leaf, jax.Array) else np
        return xp.take(leaf, order, axis=axis)

    return jax.tree_util.tree_map_with_path(reorder, params)


def state_sharding(mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """The shardings of the conv state [L, slots, K - 1, C] (over its channels) and of the recurrent
    state [L, slots, H_v, d_k, d_v] (over its value heads)."""
    return NamedSharding(mesh, P(None, None, None, TP)), NamedSharding(mesh, P(None, None, TP))
