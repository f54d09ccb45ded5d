"""One decoder layer: pre-norm attention then pre-norm MLP, each added to the residual stream
(through a post norm where the family has them, as Gemma 3), with the blocks its family's config
switches on (`PagedAttention`, `gated_mlp` or `mixture_of_experts`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from checkpoints.config import ModelConfig
from jaxserve.model.attention import AttentionBlock, PagedAttention
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.latent_attention import LatentAttention
from jaxserve.model.layer_scope import LayerScope, Quantization, layer_weights
from jaxserve.model.lora import LoraStacks
from jaxserve.model.mlp import dense_then_shared_experts, gated_mlp, mixture_of_experts
from jaxserve.model.rope import RopeTables
from kernels_pallas import AttentionBackend
from kernels_pallas.cpu_matmul import CpuMatmul

# (config, attention backend, weights' dtype) -> the attention block of a layer (`AttentionBlock`).
AttentionKind = Callable[[ModelConfig, AttentionBackend, Any], AttentionBlock]
Carry = tuple[jax.Array, Any]  # (h [T, E], the layers' cache) through the layers


class DecoderLayer(nn.Module):
    """Layer `layer` of the model. `stacked`: its parameters are stacks [num_layers, ...] of all
    the layers' (the scan); else its own (`unroll_layers`). Called on the carry (h [T, E], the
    layer group's cache); returns the new carry and the layer's expert load ([X], or [0]).

    `attention` makes the layer's attention block from the config: `PagedAttention` for every
    family served today but DeepSeek-V3 (multi-head latent attention: `LatentAttention`, its own
    cache layout); another kind of layer (another cache) is another `AttentionKind` given
    to its layers (docs/models.md: where a new layer kind plugs in)."""

    config: ModelConfig
    dtype: Any  # activations and KV cache
    param_dtype: Any
    packed: bool
    backend: AttentionBackend
    stacked: bool = False
    cpu_matmul: CpuMatmul | None = None
    experts: Callable[..., jax.Array] | None = None  # the mixture-of-experts backend (`DecoderModel.experts`)
    quantization: Quantization = ()
    attention: AttentionKind = PagedAttention
    group: str = "layers"  # its layer group's parameters (`layer_groups`: a hybrid's `linear_layers` too)

    @nn.compact
    def __call__(
        self,
        carry: Carry,
        layer: jax.Array,
        rope: RopeTables,
        meta: AttentionMetadata,
        lora: LoraStacks | None = None,
    ) -> tuple[Carry, jax.Array]:
        h, cache = carry
        cfg = self.config
        scope = LayerScope(
            layer_weights(cfg, self.stacked, self.quantization, self.group),
            layer,
            cfg.rms_norm_eps,
            self.dtype,
            self.param_dtype,
            self.packed,
            self.cpu_matmul if self.stacked else None,
            lora,
            meta.lora_slots,
        )
        kind = LatentAttention if cfg.is_mla else self.attention
        attention = kind(cfg, self.backend, self.param_dtype)
        out, cache = attention(scope, scope.norm("attn_norm", h), cache, rope, meta)
        h = h + (scope.norm("post_attn_norm", out) if cfg.post_norms else out)
        x = scope.norm("mlp_norm", h)
        if cfg.scoring_func == "sigmoid":  # DeepSeek-V3's: dense layers first, then shared and routed experts
            real = meta.real_rows(cache.block_size)
            out, load = dense_then_shared_experts(cfg, scope, x, real, self.experts)
        elif cfg.num_experts:
            real = meta.real_rows(cache.block_size)
            out, load = mixture_of_experts(cfg, scope, x, real, self.experts, self.stacked)
        else:
            out, load = gated_mlp(cfg, scope, x), jnp.zeros(0, jnp.int32)
        h = h + (scope.norm("post_mlp_norm", out) if cfg.post_norms else out)
        return (h, cache), load
