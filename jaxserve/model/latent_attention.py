"""Multi-head latent attention (DeepSeek-V3's MLA) over a paged cache of one latent per token.

Per token the cache holds [c_kv | k_pe]: the normed latent (`kv_lora_rank` values) and the rotated
key shared by all heads (`qk_rope_head_dim`), in halves in K and V (`kv_cache.cache_heads`). Every
step attends in the absorbed form: `kv_b_proj` [r, H x (nope + v)] is split per head into W_uk
[r, nope] and W_uv [r, v]; a head's query q_nope is taken into latent space (q_nope W_uk^T), its
score against a token is q_latent . c_kv + q_pe . k_pe (equal to q . k of the decompressed key),
its output softmax . c_kv is taken out of latent space by W_uv, then `o_proj`. That is
multi-query attention with one key row of r + rope values and its first r as the value, read by
the MLA backend the model is given (`kernels_pallas.mla_backends`): no step decompresses the history.

Softmax scale: (nope + rope)^-0.5, times mscale^2 for YaRN with `mscale_all_dim` (as DeepSeek and
transformers' `yarn_apply_mscale` do); RoPE as the config says, over interleaved pairs when
`rope_interleave` (de-interleaved first: q and k alike, so the scores are those of the pairs).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.config import ModelConfig
from checkpoints.weights import LAYERS
from jaxserve.model.attention import paged_attention
from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from jaxserve.model.layer_scope import LayerScope
from jaxserve.model.rope import RopeTables, apply_rope
from kernels_pallas import AttentionBackend
from kernels_pallas.mla_reference import split_latent


def softmax_scale(config: ModelConfig) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    m_all = scaling.get("mscale_all_dim")
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" and m_all and scaling["factor"] > 1:
        mscale = 0.1 * m_all * math.log(scaling["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """x [T, heads, rope] rotated; interleaved pairs are first gathered into halves."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, cos, sin)


def _per_head(x: jax.Array, w: jax.Array, spec: str) -> jax.Array:
    """Each head's x times its slice of `kv_b_proj`, in the weights' dtype with f32 accumulation
    (as every matmul of the model: the weights are never converted)."""
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """The `AttentionBlock` of a multi-head latent attention layer (module docstring)."""

    config: ModelConfig
    backend: AttentionBackend
    param_dtype: Any

    def __call__(
        self, scope: LayerScope, x: jax.Array, cache: KVCache, rope: RopeTables, meta: AttentionMetadata
    ) -> tuple[jax.Array, KVCache]:
        cfg, layer, t = self.config, scope.layer, x.shape[0]
        nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_nope, q_pe, latent = self._project(scope, x, rope)
        k_half, v_half = split_latent(latent[:, None], r)
        cache = cache.write(layer, meta.kv_slots, k_half, v_half)
        w_kv = scope.stack("kv_b_proj", "weight")
        if scope.weights["kv_b_proj/weight"].axes[0] == LAYERS:
            w_kv = w_kv[layer]
        w_kv = w_kv.reshape(r, cfg.num_heads, nope + cfg.v_head_dim)  # per head: W_uk, then W_uv
        q_latent = _per_head(q_nope, w_kv[..., :nope], "thn,rhn->thr")
        q = jnp.concatenate([q_latent, q_pe.astype(jnp.float32)], axis=-1)
        out = paged_attention(self.backend, q, cache.k, cache.v, layer, meta, scale=softmax_scale(cfg), latent_dim=r)
        out = _per_head(out, w_kv[..., nope:], "thr,rhv->thv")
        return scope.dense("o_proj", out.reshape(t, -1).astype(scope.dtype)), cache

    def _project(self, scope: LayerScope, x: jax.Array, rope: RopeTables) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q_nope [T, H, nope], rotated q_pe [T, H, rope] and the latent rows [T, r + rope] of x."""
        cfg, t = self.config, x.shape[0]
        if cfg.q_lora_rank is None:
            q = scope.dense("q_proj", x)
        else:
            q = scope.dense("q_b_proj", scope.norm("q_a_norm", scope.dense("q_a_proj", x)))
        q = q.reshape(t, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        kv = scope.dense("kv_a_proj", x)
        c_kv = scope.norm("kv_a_norm", kv[:, : cfg.kv_lora_rank])
        q_pe = _rotate(q[..., cfg.qk_nope_head_dim :], rope.cos, rope.sin, cfg.rope_interleave)
        k_pe = _rotate(kv[:, None, cfg.kv_lora_rank :], rope.cos, rope.sin, cfg.rope_interleave)[:, 0]
        return q[..., : cfg.qk_nope_head_dim], q_pe, jnp.concatenate([c_kv, k_pe.astype(c_kv.dtype)], axis=-1)
