"""A short identity of a model's weights, for keys of cached KV (disk tier, KV handoff)."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

_SAMPLED = 4096  # elements of each weight (first and last slice) that identify the weights


def weights_digest(params: Any) -> str:
    """A digest of the weights as loaded (before a runner casts, quantizes, pads or panels them): every
    array's path, shape and dtype, and the first elements of its first and last slices. Enough to
    tell checkpoints (or random seeds) apart without reading all of a large model's weights.

    An array restored in shards across processes is sampled in this process's first shard (the
    digest then names that layout too: engines laid out otherwise never share KV, never misread it)."""
    h = hashlib.blake2b(digest_size=16)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        h.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype};".encode())
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            shard = leaf.addressable_shards[0]
            h.update(f"{shard.index}".encode())
            leaf = shard.data
        if leaf.ndim:
            for part in (leaf[0], leaf[-1]):
                h.update(np.asarray(jax.device_get(part.reshape(-1)[:_SAMPLED]), dtype=np.float32).tobytes())
    return h.hexdigest()
