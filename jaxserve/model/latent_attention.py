"""Multi-head latent attention (DeepSeek-V3's MLA) over a paged cache of one latent per token.

Per token the cache holds [c_kv | k_pe]: the normed latent (`kv_lora_rank` values) and the rotated
key shared by all heads (`qk_rope_head_dim`), in halves in K and V (`kv_cache.cache_heads`).
`kv_b_proj` [r, H x (nope + v)] is split per head into W_uk [r, nope] and W_uv [r, v]. Decode (and
a short prefill step) attends in the absorbed form: a head's query q_nope is taken into latent
space (q_nope W_uk^T), its score against a token is q_latent . c_kv + q_pe . k_pe (equal to q . k
of the decompressed key), its output softmax . c_kv is taken out of latent space by W_uv, then
`o_proj`. That is multi-query attention with one key row of r + rope values and its first r as the
value, read by the MLA backend the model is given (`kernels_pallas.mla_backends`). A prefill step
of many rows decompresses instead (as vLLM and SGLang do): the latents its chunks attend to (the
cached prefix and the chunk) become per-head keys [c_kv W_uk | k_pe] and values c_kv W_uv, and
plain causal attention runs over them (`kernels_pallas.mla_decompressed`), fewer FLOPs once the
rows pass a break-even (`decompresses`); its decode rows stay absorbed.

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
from kernels_pallas.mla_decompressed import mla_decompressed_prefill
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


def decompresses(config: ModelConfig, rows: int) -> bool:
    """Whether a prefill step of `rows` query rows runs by decompression (module docstring).

    Per head, a (query, key) pair costs 2 (2r + rope) FLOPs absorbed (scores over r + rope, output
    over r) and 2 (nope + rope + v) decompressed; what each form pays once: 2 r (nope + v) per
    query absorbed (q_nope into latent space, the output out of it), the same per key decompressed
    (k_nope and v of each row attended, the cached prefix's too). A chunk of Q rows after P cached
    tokens: decompressed - absorbed = 2 r (nope + v) P - 2 (2r - nope - v) Q (P + (Q + 1) / 2) per
    head, negative for every P once Q >= r (nope + v) / (2r - nope - v) (DeepSeek-V3: 512 x 256 /
    768 = 170.7 rows; without a prefix, any Q). The step's padded row count stands for Q: fixed
    per compiled shape, so the choice adds no program."""
    cfg = config
    saving = 2 * cfg.kv_lora_rank - cfg.qk_nope_head_dim - cfg.v_head_dim
    return saving > 0 and rows * saving >= cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim)


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
        if meta.query_start is not None and decompresses(cfg, t):
            out = self._decompressed(q_nope, q_pe, cache, layer, w_kv, meta)
        else:
            q = self._absorb(q_nope, q_pe, w_kv)
            out = paged_attention(
                self.backend, q, cache.k, cache.v, layer, meta, scale=softmax_scale(cfg), latent_dim=r
            )
            out = _per_head(out, w_kv[..., nope:], "thr,rhv->thv")
        return scope.dense("o_proj", out.reshape(t, -1).astype(scope.dtype)), cache

    def _absorb(self, q_nope: jax.Array, q_pe: jax.Array, w_kv: jax.Array) -> jax.Array:
        """The absorbed queries [T, H, r + rope]: q_nope taken into latent space by W_uk, then q_pe."""
        q_latent = _per_head(q_nope, w_kv[..., : self.config.qk_nope_head_dim], "thn,rhn->thr")
        return jnp.concatenate([q_latent, q_pe.astype(jnp.float32)], axis=-1)

    def _decompressed(
        self,
        q_nope: jax.Array,
        q_pe: jax.Array,
        cache: KVCache,
        layer: jax.Array,
        w_kv: jax.Array,
        meta: AttentionMetadata,
    ) -> jax.Array:
        """A prefill step's outputs [T, H, v]: its chunks by decompression, its decode rows (if
        any) absorbed through the backend's decode, as `paged_attention` splits them."""
        cfg, p = self.config, meta.query_start.shape[0] - 1
        scale, nope = softmax_scale(cfg), cfg.qk_nope_head_dim
        out = mla_decompressed_prefill(
            q_nope,
            q_pe,
            cache.k,
            cache.v,
            layer,
            meta.block_tables[:p],
            meta.seq_lens[:p],
            meta.query_start,
            w_kv,
            scale=scale,
        )
        if meta.decode_rows is None:
            return out
        rows = jnp.minimum(meta.decode_rows, q_nope.shape[0] - 1)
        q = self._absorb(q_nope[rows], q_pe[rows], w_kv)
        decoded = self.backend.decode(
            q,
            cache.k,
            cache.v,
            layer,
            meta.block_tables[p:],
            meta.seq_lens[p:],
            scale=scale,
            latent_dim=cfg.kv_lora_rank,
        )
        return out.at[meta.decode_rows].set(_per_head(decoded, w_kv[..., nope:], "thr,rhv->thv"), mode="drop")

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
