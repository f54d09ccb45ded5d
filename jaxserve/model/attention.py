"""The attention block of a decoder layer over its layer group's cache, and the attention
backend's dispatch for a step (decode, ragged prefill, or both in one program).

Every layer's attention goes through an `AttentionBlock`: it takes the layer's normed input and
its group's cache, and returns the block's output (before the residual add) and the cache with
the step's tokens written. `PagedAttention` is multi-head / grouped query attention over the paged
K/V of `KVCache`; `latent_attention.LatentAttention` (DeepSeek-V3) reads a latent per token in the
same blocks; a kind with another cache (a recurrent state per sequence) is another
`AttentionBlock` over its own cache pytree, chosen for its layers by `DecoderLayer.attention`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from checkpoints.config import ModelConfig
from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from jaxserve.model.layer_scope import LayerScope
from jaxserve.model.rope import RopeTables, apply_rope
from kernels_pallas import AttentionBackend, reference


class AttentionBlock(Protocol):
    """The sequence-mixing block of a decoder layer, built once per layer module from the model's
    config, attention backend and weights' dtype."""

    def __call__(
        self, scope: LayerScope, x: jax.Array, cache: Any, rope: RopeTables, meta: AttentionMetadata
    ) -> tuple[jax.Array, Any]:
        """x [T, E] (normed) -> (output [T, E] in `scope.dtype`, the cache with the step's tokens
        written), for layer `scope.layer` of `cache`; projections through `scope`."""
        ...


def sliding_layers(config: ModelConfig) -> tuple[bool, ...]:
    """Per layer, whether it attends through the sliding window."""
    if config.sliding_window is None:
        return (False,) * config.num_layers
    if config.layer_types is None:
        return (True,) * config.num_layers
    return tuple(kind == "sliding_attention" for kind in config.layer_types)


def paged_attention(
    backend: AttentionBackend,
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    meta: AttentionMetadata,
    **options: Any,
) -> jax.Array:
    """q [T, H, D] -> [T, H, D] through the backend: its decode kernel for a decode step, its
    prefill kernel for ragged chunks, and both for a prefill step with decode rows, which are
    gathered for the decode kernel (one row per sequence, as it is fastest) and put back."""
    if meta.query_start is None:
        return backend.decode(q, k_cache, v_cache, layer, meta.block_tables, meta.seq_lens, **options)
    p = meta.query_start.shape[0] - 1
    prefill = backend.prefill
    if meta.visible_until is not None:  # images: only the reference takes a mask beyond causal
        prefill = functools.partial(reference.prefill_attention, visible_until=meta.visible_until)
    out = prefill(
        q, k_cache, v_cache, layer, meta.block_tables[:p], meta.seq_lens[:p], meta.query_start, **options
    )  # zeros at rows past the chunks'
    if meta.decode_rows is None:
        return out
    rows = meta.decode_rows
    decoded = backend.decode(
        q[jnp.minimum(rows, q.shape[0] - 1)],
        k_cache,
        v_cache,
        layer,
        meta.block_tables[p:],
        meta.seq_lens[p:],
        **options,
    )
    return out.at[rows].set(decoded, mode="drop")


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """Multi-head attention with grouped K/V heads over the paged `KVCache`, with the blocks a
    family declares in its config: q/k/v biases (declared weights), q/k norms, RoPE (a base of
    its own for sliding layers), a query scale, sliding-window layers, all of them or
    interleaved with full ones (each kind's kernels then run under a `lax.cond` on the layer),
    and attention sinks (gpt-oss: `layers/sinks/logits`, one per query head)."""

    config: ModelConfig
    backend: AttentionBackend
    param_dtype: Any

    def __call__(
        self, scope: LayerScope, x: jax.Array, cache: KVCache, rope: RopeTables, meta: AttentionMetadata
    ) -> tuple[jax.Array, KVCache]:
        cfg, layer = self.config, scope.layer
        sliding = sliding_layers(cfg)
        is_sliding = jnp.asarray(sliding)[layer]
        q, k, v, gate = self._project(scope, x, rope.select(is_sliding))
        cache = cache.write(layer, meta.kv_slots, k, v)
        options: dict[str, Any] = {"scale": (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5}
        if cfg.attention_sinks:
            options["sinks"] = scope.of_layer(scope.params("sinks")["logits"])
        if jnp.dtype(self.param_dtype) == jnp.bfloat16:
            # A bf16 model's queries are bf16 (on CPU, where activations are f32, the matmuls round
            # them to bf16 pairs anyway): its prefill attention then multiplies bf16 pairs too.
            q = q.astype(jnp.bfloat16)

        def attend(window: int | None):
            return lambda: paged_attention(
                self.backend, q, cache.k, cache.v, layer, meta, sliding_window=window, **options
            )

        if all(sliding) or not any(sliding):
            attn = attend(cfg.sliding_window if all(sliding) else None)()
        else:  # interleaved local and global layers: each kind's kernels, the layer's taken
            attn = lax.cond(is_sliding, attend(cfg.sliding_window), attend(None))
        attn = attn.reshape(x.shape[0], -1)
        if gate is not None:  # gated attention (Qwen3.5): each output feature times sigmoid(its gate)
            attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32))
        return scope.dense("o_proj", attn.astype(scope.dtype)), cache

    def _project(
        self, scope: LayerScope, x: jax.Array, cos_sin: tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """Queries, keys and values [T, heads, head_dim] of x, normed (q/k norms) and rotated, and
        with `attn_output_gate` the output gate [T, heads * head_dim] (q_proj's second half of each
        head's features), else None."""
        cfg, t = self.config, x.shape[0]
        q = scope.dense("q_proj", x).reshape(t, cfg.num_heads, -1)
        gate = q[..., cfg.head_dim :].reshape(t, -1) if cfg.attn_output_gate else None
        q = q[..., : cfg.head_dim]
        k = scope.dense("k_proj", x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = scope.dense("v_proj", x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = scope.norm("q_norm", q), scope.norm("k_norm", k)
        cos, sin = cos_sin
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate
