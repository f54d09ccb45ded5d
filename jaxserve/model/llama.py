"""A Flax (linen) Llama-family decoder over a paged KV cache.

One forward serves ragged prefill, decode and a mix of both: it takes a flat batch of new tokens with
their positions and cache slots, writes their K/V into the paged cache, attends over each
sequence's paged history through an attention backend (kernels_pallas), and computes logits
only at the rows asked for.

The layers are scanned (`nn.scan`) over stacked weights so that compile time does not grow
with depth. The KV cache rides in the scan carry and is updated with an in-place scatter
before it is read in the same layer; scanning it as an input would make XLA copy it per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from checkpoints.config import ModelConfig
from jaxserve.model.rope import apply_rope, attention_factor, inverse_frequencies, rope_cos_sin
from kernels_pallas import AttentionBackend


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Stacked paged cache: k and v are [num_layers, num_kv_heads, num_blocks, block_size, head_dim]."""

    k: jax.Array
    v: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @classmethod
    def zeros(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: Any) -> "KVCache":
        shape = (config.num_layers, config.num_kv_heads, num_blocks, block_size, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: Any) -> int:
        per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
        return per_token * block_size * jnp.dtype(dtype).itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where a step's new tokens go and what each sequence attends to.

    slot_mapping [T]: cache slot (block * block_size + offset) of each new token; padding rows
      point into block 0, which is never allocated.
    block_tables [S, W], seq_lens [S]: each sequence's blocks and its length after this step.
    query_start [P + 1]: row offsets of the new tokens of the first P sequences (ragged
      prefill chunks); None for a decode step, where row b is the one new token of sequence b.
    decode_rows [S - P]: a prefill step that runs decodes too (in one program): the row of
      each of the last S - P sequences' one new token (decodes), after the chunks' rows; a
      padding entry is T (out of range) and its sequence's length 0. None: no decodes.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start: jax.Array | None = None
    decode_rows: jax.Array | None = None


def paged_attention(backend: AttentionBackend, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    layer: jax.Array, meta: AttentionMetadata, **options: Any) -> jax.Array:
    """q [T, H, D] -> [T, H, D] through the backend: its decode kernel for a decode step, its
    prefill kernel for ragged chunks, and both for a prefill step with decode rows, which are
    gathered for the decode kernel (one row per sequence, as it is fastest) and put back."""
    if meta.query_start is None:
        return backend.decode(q, k_cache, v_cache, layer, meta.block_tables, meta.seq_lens, **options)
    p = meta.query_start.shape[0] - 1
    out = backend.prefill(q, k_cache, v_cache, layer, meta.block_tables[:p], meta.seq_lens[:p], meta.query_start,
                          **options)  # zeros at rows past the chunks'
    if meta.decode_rows is None:
        return out
    rows = meta.decode_rows
    decoded = backend.decode(q[jnp.minimum(rows, q.shape[0] - 1)], k_cache, v_cache, layer, meta.block_tables[p:],
                             meta.seq_lens[p:], **options)
    return out.at[rows].set(decoded, mode="drop")


class RMSNorm(nn.Module):
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * scale).astype(self.dtype)


class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Any
    backend: AttentionBackend

    @nn.compact
    def __call__(self, carry, layer, cos, sin, meta: AttentionMetadata):
        h, k_cache, v_cache = carry
        cfg = self.config
        dense = lambda feats, name, bias=False: nn.Dense(  # noqa: E731
            feats, use_bias=bias, dtype=self.dtype, param_dtype=self.dtype, name=name
        )
        t = h.shape[0]
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="attn_norm")(h)
        q = dense(cfg.num_heads * cfg.head_dim, "q_proj", cfg.attention_bias)(x)
        k = dense(cfg.num_kv_heads * cfg.head_dim, "k_proj", cfg.attention_bias)(x)
        v = dense(cfg.num_kv_heads * cfg.head_dim, "v_proj", cfg.attention_bias)(x)
        q = apply_rope(q.reshape(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.reshape(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)

        block_size = k_cache.shape[3]
        blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
        k_cache = k_cache.at[layer, :, blocks, offsets].set(k.astype(k_cache.dtype))
        v_cache = v_cache.at[layer, :, blocks, offsets].set(v.astype(v_cache.dtype))

        attn = paged_attention(self.backend, q, k_cache, v_cache, layer, meta,
                               scale=cfg.head_dim**-0.5, sliding_window=cfg.sliding_window)
        h = h + dense(cfg.hidden_size, "o_proj")(attn.reshape(t, -1).astype(self.dtype))

        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="mlp_norm")(h)
        gate = dense(cfg.intermediate_size, "gate_proj")(x)
        up = dense(cfg.intermediate_size, "up_proj")(x)
        h = h + dense(cfg.hidden_size, "down_proj")(nn.silu(gate) * up)
        return (h, k_cache, v_cache), None


def check_compute_dtype(dtype: Any, platform: str) -> None:
    """Refuse bfloat16 on CPU, where XLA:CPU (jaxlib 0.10.2) runs it pathologically, not just
    slowly: it rewrites a bf16 scatter or dynamic-update-slice as f32 by converting the whole
    operand, so each layer's KV write converts the whole stacked cache to f32 and back (~2 s per
    step with 1,024 blocks of the default model), and it reads bf16 slices of the scanned layer
    weights element by element (~0.5 G elements/s against ~6 in f32). Measured: 30-100x slower
    steps than float32, which has no such path."""
    if platform == "cpu" and jnp.dtype(dtype) == jnp.bfloat16:
        raise ValueError(
            "dtype bfloat16 is not supported on CPU: XLA:CPU runs this model 30-100x slower in "
            "bfloat16 than in float32 (it converts the whole bf16 KV cache at every cache write); "
            "use --dtype float32 (the default) on CPU"
        )


class LlamaModel(nn.Module):
    """Llama / SmolLM2 / Mistral / Qwen2 decoder. Parameter tree: see checkpoints' loaders.

    Building one checks the compute dtype against JAX's default platform (`check_compute_dtype`).
    """

    config: ModelConfig
    backend: AttentionBackend
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        check_compute_dtype(self.dtype, jax.default_backend())
        super().__post_init__()

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        """tokens, positions [T] -> (f32 logits [N, vocab] at rows logits_indices [N], new cache)."""
        cfg = self.config
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype, name="embed")
        h = embed(tokens)
        cos, sin = rope_cos_sin(positions, inverse_frequencies(cfg), attention_factor(cfg))
        layers = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
        )(cfg, self.dtype, self.backend, name="layers")
        (h, k, v), _ = layers((h, cache.k, cache.v), jnp.arange(cfg.num_layers), cos, sin, meta)
        # Every row's last hidden state, for a caller that scores more rows than it samples
        # (`head_logits`); kept only when applied with mutable=["intermediates"].
        self.sow("intermediates", "hidden", h)
        h = RMSNorm(cfg.rms_norm_eps, self.dtype, name="final_norm")(h[logits_indices])
        if cfg.tie_word_embeddings:
            logits = embed.attend(h)
        else:
            logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="lm_head")(h)
        return logits.astype(jnp.float32), KVCache(k, v)


def head_logits(config: ModelConfig, dtype: Any, params: Any, hidden: jax.Array) -> jax.Array:
    """f32 logits of last hidden states (the `hidden` rows `LlamaModel` sows): its final norm
    and output head, with its parameters."""
    x = RMSNorm(config.rms_norm_eps, dtype).apply({"params": params["final_norm"]}, hidden)
    if config.tie_word_embeddings:
        embed = nn.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype)
        logits = embed.apply({"params": params["embed"]}, x, method=nn.Embed.attend)
    else:
        head = nn.Dense(config.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype)
        logits = head.apply({"params": params["lm_head"]}, x)
    return logits.astype(jnp.float32)
