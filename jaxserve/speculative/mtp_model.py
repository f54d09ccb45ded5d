"""The multi-token prediction (MTP) layer as a function of its parameters (`mtp/` in the checkpoint's
declaration): DeepSeek-V3's (`checkpoints/architectures/deepseek_v3.py`) and Qwen3-Next's / Qwen3.5's
(`checkpoints/architectures/qwen3_5.py`, `mtp_weights`).

At position i the layer takes h_i, the target's last hidden state there after its final norm g (the target
model's output, as vLLM's `deepseek_mtp` and `qwen3_next_mtp` take it), and the token after it, t_{i+1}:

    x = eh_proj([enorm(embed(t_{i+1})) | hnorm(g(h_i))])      (the embedding first, as the checkpoints and vLLM)
    h' = decoder layer (over the layer's own paged cache, then the model's MLP or mixture of experts)
    logits(t_{i+2}) = head(head_norm(h'))

DeepSeek-V3: the layer's attention is MLA over a latent cache, its checkpoint stores its own copies of the
embedding and head, and the token embedding at position 0 is zeroed (as vLLM's `deepseek_mtp` does); a chain
feeds h' back. Qwen3-Next / Qwen3.5: a gated full-attention layer over K/V heads, the model's own embedding
and head (tied or not); a chain feeds head_norm(h') back. Chaining several drafts feeds that state to the next
position, with the token just drafted; g does not apply to it (it is not a target's state).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.architectures.layer_groups import FULL_ATTENTION
from checkpoints.config import ModelConfig
from jaxserve.model.experts import expert_backend
from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from jaxserve.model.layer_stack import LayerStack
from jaxserve.model.linear import matmul
from jaxserve.model.rope import rope_tables


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The config of the MTP's decoder layer: one layer, a mixture of experts (DeepSeek-V3's MTP layer
    comes after the dense ones), full attention (a hybrid's), and no MTP of its own. Its cache (latent or
    K/V heads) has this one layer."""
    kinds = (FULL_ATTENTION,) if config.layer_types else None
    return dataclasses.replace(
        config, num_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0, layer_types=kinds
    )


def mtp_layer_stack(config: ModelConfig, dtype: Any, param_dtype: Any, backend: Any, experts: Any = None) -> LayerStack:
    """How the MTP's decoder layer of a target of `config` is built: activations in `dtype`, weights in
    `param_dtype`, the target's attention backend and expert function (`experts`; None: the default for a
    mixture of experts). Its weights are its own, as loaded (not in the target's panels or packed pairs:
    `layout` converts only `layers`)."""
    layer_config = mtp_layer_config(config)
    if experts is None and layer_config.num_experts:
        experts = expert_backend(layer_config)
    return LayerStack(layer_config, dtype, param_dtype, False, backend, None, experts, ())


def mtp_params(params: Any) -> dict[str, Any]:
    """What `mtp_forward` reads of a target's parameters: `mtp` (the checkpoint's MTP module), the embedding
    table and head kernel it uses (DeepSeek-V3's own copies, stacked per MTP layer; else the model's, the
    head absent where tied) and the target's final norm (`hidden_norm`, g). The arrays are the target's
    (nothing copied)."""
    mtp, hidden_norm = params["mtp"], params["final_norm"]["scale"]
    if "embedding" in mtp:
        head = mtp["head"]["kernel"]
        return {"mtp": mtp, "embedding": mtp["embedding"]["table"], "head": head, "hidden_norm": hidden_norm}
    out = {"mtp": mtp, "embedding": params["embed"]["embedding"], "hidden_norm": hidden_norm}
    if "lm_head" in params:
        out["head"] = params["lm_head"]["kernel"]
    return out


def _one(x: jax.Array, ndim: int) -> jax.Array:
    """The first MTP layer's entry of a stacked array (DeepSeek-V3's per-layer copies), else `x` itself."""
    return x[0] if x.ndim > ndim else x


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
    chained: bool = False,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """(f32 logits [N, V] and the hidden state a chain feeds to the next position [N, E] at `rows`, the cache
    with the rows' K/V or latents written). tokens [T]: t_{i+1} of each row; hidden [T, E]: h_i, a target's
    state unless `chained` (what an earlier call returned); positions [T]: i; `params`: `mtp_params` of the
    target's; `stack`: how the decoder layer is built (its config `mtp_layer_config`). The state returned is
    the layer's output h' (DeepSeek-V3), or head_norm(h') (Qwen3-Next, Qwen3.5: vLLM's chain feeds the MTP's
    normed output back)."""
    cfg, act, eps = stack.config, stack.dtype, stack.config.rms_norm_eps
    mtp = params["mtp"]
    embedded = _one(params["embedding"], 2)[tokens].astype(jnp.float32)
    if cfg.is_mla:  # DeepSeek-V3
        embedded = jnp.where((positions == 0)[:, None], 0.0, embedded)
    if not chained:
        hidden = rms_norm(hidden, params["hidden_norm"], eps)
    x = jnp.concatenate(
        [
            rms_norm(embedded, _one(mtp["enorm"]["scale"], 1), eps),
            rms_norm(hidden, _one(mtp["hnorm"]["scale"], 1), eps),
        ],
        axis=-1,
    )
    x = matmul(x.astype(act), _one(mtp["eh_proj"]["kernel"], 2)).astype(act)
    layer = stack.scanned(1, parent=None)
    (h, cache), _ = layer.apply(
        {"params": mtp["layer"]}, (x, cache), jnp.arange(1), rope_tables(cfg, positions), meta, None
    )
    normed = rms_norm(h[rows], _one(mtp["head_norm"]["scale"], 1), eps)
    if "head" in params:
        logits = matmul(normed.astype(act), _one(params["head"], 2))
    else:  # tied: the embedding table [V, E] is the head
        logits = matmul(normed.astype(act), params["embedding"], contract_w=1)
    # the state a chain's next position takes: DeepSeek-V3's layer output, else the output as the head reads it
    return logits, (h[rows] if cfg.is_mla else normed.astype(act)), cache
