"""EAGLE-3 speculation: a head of one decoder layer over three of the target's hidden states (`eagle3_model`)
drafts k tokens per decode as a chain.

It is drafted for as the MTP layer is (`MtpProposer`: its own paged cache in `DraftKV` blocks freed on release,
catch-up in chunks, the target's rows handed over by the engine and kept per request until caught up, greedy or
sampled drafts with q for rejection sampling), with the EAGLE-3 head's forward as its chain and, as the target's
row at each position, the residual streams entering the head's three aux layers (the target model sows them
only when EAGLE-3 is configured: `ResolvedConfig.aux_hidden_layers`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.model.kv_cache import KVCache
from jaxserve.resolved_config import ResolvedConfig
from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.draft_model import DraftDevice, DraftShapes
from jaxserve.speculative.eagle3_config import NUM_AUX, read_eagle3_config
from jaxserve.speculative.eagle3_model import Eagle3Head, eagle3_forward
from jaxserve.speculative.eagle3_weights import load_eagle3_weights
from jaxserve.speculative.mtp_programs import hidden_chain
from jaxserve.speculative.mtp_proposer import MtpProposer
from sharding.rules import cache_sharding, replicated

logger = logging.getLogger(__name__)


def build_eagle3_proposer(spec: SpeculativeConfig, ec: ResolvedConfig, runner: Any) -> MtpProposer:
    """The EAGLE-3 proposer of the head at `spec.model` for the target `runner` serves (`ModelRunner`, built
    with the head's aux layers: `ec.aux_hidden_layers`): the head's weights in the target's dtype (its
    embedding the target's unless it has its own), the target's attention backend, and a cache of one layer
    with as many blocks as the target's (each head position is a target position)."""
    cfg = read_eagle3_config(spec.model, runner.config)
    if cfg.aux_layers != ec.aux_hidden_layers:
        raise ValueError(f"the EAGLE-3 head's aux layers {cfg.aux_layers} are not the target's {ec.aux_hidden_layers}")
    weights = load_eagle3_weights(spec.model, cfg)
    dtype = jnp.dtype(ec.dtype)
    params = {name: a if name == "targets" else a.astype(dtype) for name, a in weights.items()}
    params = jax.device_put(params, replicated(runner.mesh))
    if "embedding" not in params:  # shared with the target (nothing copied)
        params["embedding"] = runner.params["embed"]["embedding"]
    model = runner.model
    head = Eagle3Head(cfg.layer, model.backend, model.compute_dtype, cfg.norm_before_residual)
    cache = jax.jit(
        lambda: KVCache.zeros(cfg.layer, ec.num_blocks, ec.block_size, runner.kv_dtype),
        out_shardings=cache_sharding(runner.mesh),
    )()
    block_bytes = KVCache.bytes_per_block(cfg.layer, ec.block_size, runner.kv_dtype)
    logger.info(
        "EAGLE-3 head %s: aux layers %s, draft vocabulary %d; its cache %d blocks (%.1f MB)",
        spec.model,
        list(cfg.aux_layers),
        cfg.draft_vocab_size,
        ec.num_blocks,
        ec.num_blocks * block_bytes / 1e6,
    )
    device = DraftDevice(head, params, cache, ec.num_blocks, ec.block_size)
    shapes = DraftShapes.for_config(
        ec.verify_batch_buckets, spec.num_speculative_tokens, ec.prefill_token_buckets, ec.block_table_buckets
    )
    chain = functools.partial(hidden_chain, eagle3_forward)
    return MtpProposer(spec, ec.max_model_len, device, shapes, NUM_AUX * runner.config.hidden_size, chain)
