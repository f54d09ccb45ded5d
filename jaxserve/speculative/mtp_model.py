"""DeepSeek-V3's multi-token prediction (MTP) layer as a function of its parameters (`mtp/` in the
checkpoint's declaration, `checkpoints/architectures/deepseek_v3.py`).

At position i the layer takes h_i, the target's last hidden state there (before its final norm), and the
token after it, t_{i+1}:

    x = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])      (the embedding first, as DeepSeek and vLLM)
    h' = decoder layer (MLA over the layer's own latent cache, then the mixture of experts)
    logits(t_{i+2}) = head(head_norm(h'))

The token embedding at position 0 is zeroed (as vLLM's `deepseek_mtp` does). Chaining several drafts
feeds h' back as the next position's hidden state, with the token just drafted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.config import ModelConfig
from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from jaxserve.model.layer_stack import LayerStack
from jaxserve.model.linear import matmul
from jaxserve.model.rope import rope_tables


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The config of the MTP's decoder layer: one layer, a mixture of experts (DeepSeek-V3's MTP layer
    comes after the dense ones), and no MTP of its own. Its latent cache has this one layer."""
    return dataclasses.replace(config, num_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMS norm in f32 (as `jaxserve.model.norm.RMSNorm`)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale.astype(jnp.float32)


def mtp_forward(
    stack: LayerStack,
    params: Any,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    meta: AttentionMetadata,
    rows: jax.Array,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """(f32 logits [N, V] and the layer's output h' [N, E] at `rows`, the cache with the rows' latents
    written). tokens [T]: t_{i+1} of each row; hidden [T, E]: h_i; positions [T]: i; `params`: the
    checkpoint's `mtp` parameters (stacks of one layer); `stack`: how the decoder layer is built
    (its config `mtp_layer_config`)."""
    cfg, act, eps = stack.config, stack.dtype, stack.config.rms_norm_eps
    embedded = params["embedding"]["table"][0][tokens].astype(jnp.float32)
    embedded = jnp.where((positions == 0)[:, None], 0.0, embedded)
    x = jnp.concatenate(
        [rms_norm(embedded, params["enorm"]["scale"][0], eps), rms_norm(hidden, params["hnorm"]["scale"][0], eps)],
        axis=-1,
    )
    x = matmul(x.astype(act), params["eh_proj"]["kernel"][0]).astype(act)
    layer = stack.scanned(1, parent=None)
    (h, cache), _ = layer.apply(
        {"params": params["layer"]}, (x, cache), jnp.arange(1), rope_tables(cfg, positions), meta, None
    )
    out = h[rows]
    normed = rms_norm(out, params["head_norm"]["scale"][0], eps).astype(act)
    return matmul(normed, params["head"]["kernel"][0]), out, cache
