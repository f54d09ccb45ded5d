"""Builds an engine's disk tier: the fingerprint of what its KV bytes depend on, and the tier on
the runner's host-tier arrays. (Here, not in jaxserve/kv, because it reads the model's arrays.)"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxserve.kv import DiskTier, HostBlockArrays, fingerprint
from kernels_pallas import kv_quant

if TYPE_CHECKING:
    from jaxserve.runner import ModelRunner

logger = logging.getLogger(__name__)

_SAMPLED = 4096  # elements of each weight (first and last slice) that identify the weights


def weights_digest(params) -> str:
    """A digest of the weights: every array's path, shape and dtype, and the first elements of its
    first and last slices. Enough to tell checkpoints (or random seeds) apart without reading
    all of a large model's weights back from the devices."""
    h = hashlib.blake2b(digest_size=16)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        h.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype};".encode())
        if leaf.ndim:
            for part in (leaf[0], leaf[-1]):
                h.update(np.asarray(jax.device_get(part.reshape(-1)[:_SAMPLED]), dtype=np.float32).tobytes())
    return h.hexdigest()


def kv_fingerprint(runner: ModelRunner, model_name: str) -> bytes:
    """Everything that changes the bytes of a KV block."""
    config, ec = runner.config, runner.engine_config
    return fingerprint({
        "model": model_name, "weights": weights_digest(runner.params), "dtype": str(runner.dtype),
        "kv_cache_dtype": kv_quant.format_name(runner.kv_dtype),
        "block_size": ec.block_size, "tensor_parallel_size": ec.tensor_parallel_size,
        # layers, kv heads as served (repeated under tensor parallelism), head dim, RoPE, ...
        "config": repr(config),
        "attention_backend": runner.attention_backend, "platform": jax.default_backend(),
    })


def build_disk_tier(runner: ModelRunner, model_name: str) -> DiskTier | None:
    ec = runner.engine_config
    if ec.kv_disk_dir is None:
        return None
    if jax.process_count() > 1:
        raise ValueError("the disk tier (--kv-disk-dir) runs in one process only, not across hosts")
    host = HostBlockArrays([runner.blocks.host_k, runner.blocks.host_v])
    tier = DiskTier(ec.kv_disk_dir, kv_fingerprint(runner, model_name), ec.block_size, host, ec.kv_disk_bytes,
                    ec.kv_disk_max_inflight_bytes)
    runner.blocks.disk_sink = tier.write
    logger.info("KV disk tier in %s: %d blocks (%.1f MB) found, budget %.1f GB", tier.root, tier.num_files,
                tier.num_bytes / 1e6, ec.kv_disk_bytes / 1e9)
    return tier
