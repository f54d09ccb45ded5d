"""What the runner serves, built once from a checkpoint's config and parameters: the model on its
mesh (tensor parallel heads, pipeline stages, the attention and matmul kernels, quantized kernels),
the parameters laid out and placed for it (with the LoRA slots), and the KV cache's size and format.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from checkpoints.architectures.layer_groups import is_hybrid, paged_config
from checkpoints.config import ModelConfig
from checkpoints.quantize import GGUF, INT8, Q4, formats_of, quantize_head, quantize_params
from jaxserve.model import DecoderModel, KVCache
from jaxserve.model.experts import expert_backend
from jaxserve.model.layout import pack_kernels, panel_kernels, unstack_layers
from jaxserve.model.lora import LORA_MODULES
from jaxserve.model.state_cache import LinearStateCache, ModelCaches
from jaxserve.resolved_config import ResolvedConfig
from jaxserve.runner.lora_slots import LoraSlots
from jaxserve.runner.pipeline_placement import pipeline_layers, plan_stages, stage_model_config, stage_params
from jaxserve.runner.placement import cast_params, plan_parallelism
from kernels_pallas import cpu_matmul, default_attention_backend, get_attention_backend, kv_quant, shard_attention
from kernels_pallas.mla_backends import get_mla_backend, shard_latent_attention
from sharding.kv_heads import replicate_kv_heads
from sharding.linear_heads import shard_linear_channels, state_sharding
from sharding.rules import cache_sharding, layer_sharding, param_shardings

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServedModel:
    """The model as served: `config` is what the model and cache are built with (tensor parallel may
    repeat kv heads; pipeline stages may pad the layers), `params` are placed on the mesh."""

    config: ModelConfig
    model: DecoderModel
    stages: Any  # PipelineStages, or None
    dtype: jnp.dtype  # of the weights
    attention_backend: str
    quantization: dict[str, str]
    kv_dtype: Any  # the KV cache's storage dtype (its format: kernels_pallas/kv_quant.py)
    params: Any
    param_shardings: Any
    lora_slots: LoraSlots | None
    adapters: Any  # the LoRA slots' arrays, placed (None without LoRA)


def serve_model(config: ModelConfig, params: Any, ec: ResolvedConfig, mesh: Mesh) -> ServedModel:
    """The model, and its parameters quantized, laid out for its kernels and placed on `mesh`."""
    # Tensor parallel: heads split over "tp"; kv heads repeated where tp needs more of them.
    plan = plan_parallelism(config, ec)
    config = dataclasses.replace(config, num_kv_heads=plan.served_kv_heads)
    if is_hybrid(config):  # Gated DeltaNet conv channels by shard (sharding.linear_heads)
        params = shard_linear_channels(params, config, plan.tp)
        config = dataclasses.replace(config, linear_shards=plan.tp)
    # Pipeline stages: the layers (weights and cache) in whole stages over "pp" (pipeline_placement).
    stages = plan_stages(config, ec)
    if stages is not None:
        logger.info("pipeline stages: %s", stages.describe())
        config = stage_model_config(config, stages)
    dtype = jnp.dtype(ec.dtype)
    backend = ec.attention_backend or default_attention_backend()
    if config.is_mla:  # multi-head latent attention reads its latent cache with backends of its own
        attention = shard_latent_attention(get_mla_backend(backend), mesh, "tp")
    else:
        attention = shard_attention(get_attention_backend(backend), mesh, "tp")
    # One CPU device with f32 or bf16 weights, the cpu backend and scanned layers: the layers'
    # matmuls read their layer of the stacked weights, stored in panels, in place, and the tied
    # head is a C++ kernel too (kernels_pallas/cpu_matmul.py).
    native = backend == "cpu" and dtype in cpu_matmul.WEIGHT_DTYPES and mesh.size == 1 and not ec.unroll_layers
    matmul = cpu_matmul.kernels() if native else None
    experts = expert_backend(config, mesh) if config.num_experts else None
    # Weight-only quantization: kernels quantized here (int8, q4), or as the checkpoint stored them
    # (gguf; its output head quantized here where the file's type is not one kept as stored).
    if ec.quantization in (INT8, Q4):
        params = quantize_params(params, config, ec.quantization)
    elif ec.quantization == GGUF:
        params = quantize_head(params, config)
    quantization = formats_of(params)
    pipeline = pipeline_layers(mesh, ec) if stages is not None else None
    formats = tuple(sorted(quantization.items()))
    model = DecoderModel(
        config, attention, dtype, ec.unroll_layers, matmul, experts, formats, pipeline, ec.aux_hidden_layers
    )
    # auto: the weights' dtype, as vLLM's, also on CPU where bf16 weights' activations are f32 (a
    # bf16 cache halves the bytes a decode step's attention reads: a batch-64 step at 256 tokens
    # 0.69x the time).
    kv_dtype = jnp.dtype(ec.kv_storage_dtype)  # resolved with the config (jaxserve/config_resolution.py)
    params = replicate_kv_heads(cast_params(params, dtype), plan, config.head_dim)
    if stages is not None:
        params = stage_params(params, stages)
    if matmul is not None:
        params = panel_kernels(params, matmul)
    if model.packed:
        params = pack_kernels(params)  # those the panels did not take
    served = ServedModel(config, model, stages, dtype, backend, quantization, kv_dtype, params, None, None, None)
    _place_params(served, ec, mesh, dataclasses.replace(config, num_kv_heads=plan.num_kv_heads), plan.kv_replicas)
    return served


def _place_params(served: ServedModel, ec: ResolvedConfig, mesh: Mesh, lora_config: ModelConfig, replicas: int) -> None:
    """Place the parameters on the mesh, and the LoRA adapters' empty LoRA slots, split like the
    projections they update."""
    config, params = served.config, served.params
    shardings = param_shardings(params, mesh, config, served.quantization)
    if ec.enable_lora:
        kernels = {m: s["kernel"].spec for m, s in shardings["layers"].items() if m in LORA_MODULES}
        served.lora_slots = LoraSlots(
            lora_config, ec.max_loras, ec.max_lora_rank, served.model.compute_dtype, mesh, kernels, replicas
        )
    if ec.unroll_layers:
        params = unstack_layers(params, config.num_layers, lambda leaf, i: leaf[i])
        shardings = unstack_layers(shardings, config.num_layers, layer_sharding)
    served.params, served.param_shardings = jax.device_put(params, shardings), shardings
    if served.lora_slots is not None:
        served.adapters = served.lora_slots.zeros()


def caches_sharding(config: ModelConfig, mesh: Mesh, block_size: int) -> Any:
    """Where the model's caches lie: the paged cache split over kv heads (a latent cache replicated); a
    hybrid's states split over their heads (`sharding.linear_heads`)."""
    if not is_hybrid(config):
        return cache_sharding(mesh, config.is_mla)
    return ModelCaches(cache_sharding(mesh), LinearStateCache(*state_sharding(mesh), block_size))


def build_cache(config: ModelConfig, ec: ResolvedConfig, mesh: Mesh, kv_dtype: Any) -> KVCache | ModelCaches:
    """The zeroed KV cache of the resolved number of blocks (`ResolvedConfig.num_blocks`: from
    `num_blocks`, or the blocks `kv_cache_memory` per device holds); a hybrid's with its layer
    groups' other caches (`ModelCaches`: the state slots `ResolvedConfig.num_state_slots`)."""
    bs, num_blocks, block_bytes = ec.block_size, ec.num_blocks, ec.kv_block_bytes

    def zeros() -> KVCache | ModelCaches:
        paged = KVCache.zeros(paged_config(config), num_blocks, bs, kv_dtype)
        return (
            ModelCaches(paged, LinearStateCache.zeros(config, ec.num_state_slots, bs)) if is_hybrid(config) else paged
        )

    cache = jax.jit(zeros, out_shardings=caches_sharding(config, mesh, bs))()
    logger.info(
        "KV cache: %s, %d blocks of %d tokens (%d tokens in %.1f MB: %d tokens per GiB)",
        kv_quant.format_name(kv_dtype),
        num_blocks,
        bs,
        num_blocks * bs,
        num_blocks * block_bytes / 1e6,
        (1 << 30) * bs // block_bytes,
    )
    return cache
