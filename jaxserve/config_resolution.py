"""`resolve`: an `EngineConfig` for a model, resolved once before anything is built (`ResolvedConfig`).

The facts of the served model come from the same functions the runner builds it with: the weights' dtype
(`jaxserve.dtype_choice`), the kv heads tensor parallelism repeats and the layers pipeline stages pad to
(`jaxserve.runner.placement`, `jaxserve.runner.pipeline_placement`), and the KV cache's storage dtype
(`kernels_pallas.kv_quant`); `jaxserve.resolved_config.resolve_limits` does the arithmetic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from checkpoints.architectures.layer_groups import is_hybrid, paged_config
from checkpoints.config import ModelConfig
from jaxserve.config import EngineConfig
from jaxserve.dtype_choice import weights_dtype
from jaxserve.model import KVCache
from jaxserve.model.attention import sliding_layers
from jaxserve.model.state_cache import LinearStateCache
from jaxserve.resolved_config import ResolvedConfig, ServedModel, resolve_limits
from jaxserve.runner.pipeline_placement import plan_stages, stage_model_config
from jaxserve.runner.placement import plan_parallelism
from jaxserve.speculative.eagle3_config import check_eagle3_target
from jaxserve.speculative.mtp_target import check_mtp_target
from kernels_pallas import default_attention_backend, kv_quant


def resolve(config: EngineConfig, model: ModelConfig, dtype: str | None = None) -> ResolvedConfig:
    """`config` as served for `model`. `dtype`: the weights' dtype, when it was already chosen to load them
    (`weights_dtype(config)`); None: chosen here. ValueError for what the model and the config cannot run."""
    return resolve_limits(config, served_model(config, model, dtype or weights_dtype(config)))


def check_latent_attention(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError naming the settings a multi-head latent attention model (DeepSeek-V3) is not
    served with: its dense and expert layers are stacks of their own (no pipeline stages, no
    unrolled layers), its projections take no LoRA, and its latent cache is stored unscaled."""
    if not model.is_mla:
        return
    refused = {
        f"pipeline_parallel_size={config.pipeline_parallel_size}": config.pipeline_parallel_size > 1,
        "unroll_layers=True": config.unroll_layers,
        "enable_lora=True": config.enable_lora,
        f"kv_cache_dtype={config.kv_cache_dtype}": config.kv_cache_dtype in ("fp8", "fp8_e4m3", "int8"),
    }
    settings = [name for name, on in refused.items() if on]
    if settings:
        raise ValueError(f"{model.architecture} (multi-head latent attention) is not served with {', '.join(settings)}")


def served_model(config: EngineConfig, model: ModelConfig, dtype: str) -> ServedModel:
    """The facts of `model` served with `config` and weights of `dtype` that resolution needs. A
    latent cache (multi-head latent attention) has no heads to split: every tensor-parallel device
    holds all of it, so a block's bytes over the devices count it once per device."""
    check_latent_attention(config, model)
    check_mtp_target(config, model)
    aux_layers = check_eagle3_target(config, model)
    served = dataclasses.replace(model, num_kv_heads=plan_parallelism(model, config).served_kv_heads)
    stages = plan_stages(served, config)
    if stages is not None:
        served = stage_model_config(served, stages)
    kv_dtype = kv_quant.storage_dtype(config.kv_cache_dtype, jnp.dtype(dtype), jax.default_backend())
    latent_copies = config.tensor_parallel_size if model.is_mla else 1
    return ServedModel(
        context=model.max_position_embeddings,
        dtype=dtype,
        attention_backend=config.attention_backend or default_attention_backend(),
        kv_storage_dtype=kv_dtype.name,
        kv_block_bytes=KVCache.bytes_per_block(paged_config(served), config.block_size, kv_dtype) * latent_copies,
        kv_devices=config.tensor_parallel_size * config.pipeline_parallel_size,
        state_slot_bytes=LinearStateCache.bytes_per_slot(served) if is_hybrid(served) else 0,
        sliding_window=model.sliding_window if all(sliding_layers(model)) else None,
        aux_hidden_layers=aux_layers,
    )
