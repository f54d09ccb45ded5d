"""Repeat kv heads in the k/v projections so that every tensor-parallel shard owns whole kv heads.

See `sharding.mesh.TensorParallelPlan`: with r = `plan.kv_replicas`, kv head j becomes heads
j*r .. j*r + r - 1. The model, built with `num_kv_heads = plan.served_kv_heads`, then computes
(and caches) r identical copies of each head, one per shard that needs it.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharding.mesh import TensorParallelPlan

_KV_LEAF = re.compile(r"^layers/(k|v)_proj/(kernel|kernel_scale|kernel_min|bias)$")  # and quantized arrays


def replicate_kv_heads(params: dict[str, Any], plan: TensorParallelPlan, head_dim: int) -> dict[str, Any]:
    """A parameter tree whose k/v projections output `plan.served_kv_heads` heads (numpy leaves
    stay numpy, jax leaves stay jax); the tree itself when no replication is needed."""
    if plan.kv_replicas == 1:
        return params

    def repeat(keys: tuple, leaf: Any) -> Any:
        path = "/".join(str(k.key) for k in keys)
        if not _KV_LEAF.match(path):
            return leaf
        xp = jnp if isinstance(leaf, jax.Array) else np
        *lead, features = leaf.shape
        if features != plan.num_kv_heads * head_dim:
            raise ValueError(f"{path} has {features} output features, expected {plan.num_kv_heads} x {head_dim}")
        heads = leaf.reshape(*lead, plan.num_kv_heads, head_dim)
        return xp.repeat(heads, plan.kv_replicas, axis=-2).reshape(*lead, plan.served_kv_heads * head_dim)

    return jax.tree_util.tree_map_with_path(repeat, params)
