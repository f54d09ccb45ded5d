"""Builds an engine's tier below the host tier (the disk tier, the pool tier, or both chained: disk
first, then pool): the fingerprint of what its KV bytes depend on, and the tier on the runner's
host-tier arrays. (Here, not in jaxserve/kv, because it reads the model's arrays.)"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import jax

from jaxserve.kv import DiskTier, HostBlockArrays, KVTier, PoolTier, TierChain, fingerprint
from jaxserve.mooncake_store import MooncakeBlockStore
from jaxserve.runner.pipeline_placement import model_layers_config
from kernels_pallas import kv_quant

if TYPE_CHECKING:
    from jaxserve.runner import ModelRunner

logger = logging.getLogger(__name__)


def kv_fingerprint(runner: ModelRunner, model_name: str, model_layers: bool = False) -> bytes:
    """Everything that changes the bytes of a KV block: as this runner's cache holds them (the disk
    tier's files), or with `model_layers` as the KV handoff moves them, one row per model layer
    (uneven pipeline stages' identity layers left out: `jaxserve.kv_transfer`)."""
    config, ec = runner.config, runner.engine_config
    if model_layers and runner.stages is not None:
        config = model_layers_config(config, runner.stages)
    return fingerprint(
        {
            "model": model_name,
            "weights": runner.weights_digest,
            "dtype": str(runner.dtype),
            "quantization": ec.quantization,
            "kv_cache_dtype": kv_quant.format_name(runner.kv_dtype),
            "block_size": ec.block_size,
            "tensor_parallel_size": ec.tensor_parallel_size,
            # layers, kv heads as served (repeated under tensor parallelism), head dim, RoPE, ...
            "config": repr(config),
            "attention_backend": runner.attention_backend,
            "platform": jax.default_backend(),
        }
    )


def build_lower_tier(runner: ModelRunner, model_name: str) -> KVTier | None:
    """The disk tier (--kv-disk-dir), the pool tier (--kv-pool), both chained (the disk first), or None."""
    ec = runner.engine_config
    tiers: list[KVTier] = []
    if ec.kv_disk_dir is not None:
        tiers.append(build_disk_tier(runner, model_name))
    if ec.kv_pool is not None:
        try:
            tiers.append(build_pool_tier(runner, model_name))
        except BaseException:
            for tier in tiers:  # the disk tier's threads stop with the failed start
                tier.close()
            raise
    if not tiers:
        return None
    tier = tiers[0] if len(tiers) == 1 else TierChain(*tiers)
    runner.blocks.disk_sink = tier.write
    return tier


def build_pool_tier(runner: ModelRunner, model_name: str) -> PoolTier:
    ec = runner.engine_config
    if jax.process_count() > 1:
        raise ValueError("the pool tier (--kv-pool) runs in one process per engine, not across hosts")
    store = MooncakeBlockStore(ec.kv_pool, ec.kv_pool_local_host, ec.kv_pool_segment_bytes)
    host = HostBlockArrays([runner.blocks.host_k, runner.blocks.host_v])
    tier = PoolTier(
        store,
        kv_fingerprint(runner, model_name),
        ec.block_size,
        host,
        ec.kv_pool_segment_bytes,
        max_inflight_bytes=ec.kv_disk_max_inflight_bytes,
    )
    logger.info("KV pool tier at %s: lending it %.1f GB", ec.kv_pool, ec.kv_pool_segment_bytes / 1e9)
    return tier


def build_disk_tier(runner: ModelRunner, model_name: str) -> DiskTier:
    ec = runner.engine_config
    if jax.process_count() > 1:
        raise ValueError("the disk tier (--kv-disk-dir) runs in one process only, not across hosts")
    host = HostBlockArrays([runner.blocks.host_k, runner.blocks.host_v])
    tier = DiskTier(
        ec.kv_disk_dir,
        kv_fingerprint(runner, model_name),
        ec.block_size,
        host,
        ec.kv_disk_bytes,
        ec.kv_disk_max_inflight_bytes,
    )
    logger.info(
        "KV disk tier in %s: %d blocks (%.1f MB) found, budget %.1f GB",
        tier.root,
        tier.num_blocks,
        tier.num_bytes / 1e6,
        ec.kv_disk_bytes / 1e9,
    )
    return tier
