"""An EAGLE-3 head as a function of its parameters (`eagle3_weights`), as vLLM's `llama_eagle3` computes it.

At position i the head takes the token after it, t_{i+1}, and a hidden state g_i of width E: on the first pass
g_i = fc([a_i | b_i | c_i]), the target's residual streams entering its three aux layers at i
(`DecoderModel.aux_layers`); along a chain, the head's own pre-norm output at the position before.

    x = [input_norm(embed(t_{i+1})) | hidden_norm(g_i)]                (2 E: the embedding first)
    h = g_i + o_proj(attention(q/k/v_proj(x)))                         (its one layer, its own paged cache,
                                                                        RoPE of the head's config)
    h' = h + mlp(post_attention_norm(h))                               (the pre-norm output a chain feeds on)
    logits(t_{i+2}) = lm_head(norm(h'))  over the draft vocabulary, scattered to the target ids (d + d2t[d]),
                                          -inf at target ids the head cannot draft

(`norm_before_residual` heads start the residual from hidden_norm(g_i) instead). The logits are over the
target's vocabulary, so drafts are target ids and q (for rejection sampling) is the target vocabulary's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.config import ModelConfig
from jaxserve.model.attention import paged_attention
from jaxserve.model.experts import activation
from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from jaxserve.model.linear import matmul
from jaxserve.model.rope import apply_rope, rope_tables
from jaxserve.speculative.mtp_model import rms_norm
from kernels_pallas import AttentionBackend


@dataclasses.dataclass(frozen=True)
class Eagle3Head:
    """How the head is computed (static under jit): its layer's config (`Eagle3Config.layer`), the target's
    attention backend, the activations' dtype, and where its residual starts."""

    config: ModelConfig
    backend: AttentionBackend
    dtype: Any
    norm_before_residual: bool = False


def _attention(
    head: Eagle3Head, params: Any, x: jax.Array, positions: jax.Array, cache: KVCache, meta: AttentionMetadata
) -> tuple[jax.Array, KVCache]:
    """o_proj of the head's attention of x [T, 2 E] over its cache (layer 0), with the rows' K/V written."""
    cfg, t = head.config, x.shape[0]
    q = matmul(x, params["q_proj"]).reshape(t, cfg.num_heads, cfg.head_dim)
    k = matmul(x, params["k_proj"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = matmul(x, params["v_proj"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    rope = rope_tables(cfg, positions)
    q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
    layer = jnp.int32(0)
    cache = cache.write(layer, meta.kv_slots, k.astype(head.dtype), v.astype(head.dtype))
    attn = paged_attention(head.backend, q.astype(head.dtype), cache.k, cache.v, layer, meta, scale=cfg.head_dim**-0.5)
    return matmul(attn.reshape(t, -1).astype(head.dtype), params["o_proj"]), cache


def eagle3_forward(
    head: Eagle3Head,
    params: Any,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    meta: AttentionMetadata,
    rows: jax.Array,
    chained: bool = False,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """(f32 logits [N, V] over the target's vocabulary and the pre-norm output a chain feeds on [N, E], at
    `rows`; the cache with the rows' K/V written). tokens [T]: t_{i+1}; hidden: the target's aux states
    [T, 3 E] unless `chained` (then [T, E], what an earlier call returned); positions [T]: i."""
    cfg, act, eps = head.config, head.dtype, head.config.rms_norm_eps
    if not chained:
        hidden = matmul(hidden.astype(act), params["fc"])
    hidden = hidden.astype(jnp.float32)
    normed = rms_norm(hidden, params["hidden_norm"], eps)
    embedded = rms_norm(params["embedding"][tokens].astype(jnp.float32), params["input_norm"], eps)
    x = jnp.concatenate([embedded, normed], axis=-1).astype(act)
    out, cache = _attention(head, params, x, positions, cache, meta)
    h = (normed if head.norm_before_residual else hidden) + out
    x = rms_norm(h, params["post_attention_norm"], eps).astype(act)
    gated = activation(cfg.hidden_act)(matmul(x, params["gate_proj"])) * matmul(x, params["up_proj"])
    h = h + matmul(gated.astype(act), params["down_proj"])
    state = h[rows]
    draft_logits = matmul(rms_norm(state, params["norm"], eps).astype(act), params["lm_head"], contract_w=1)
    logits = jnp.full((state.shape[0], cfg.vocab_size), -jnp.inf, jnp.float32)
    return logits.at[:, params["targets"]].set(draft_logits), state.astype(act), cache
