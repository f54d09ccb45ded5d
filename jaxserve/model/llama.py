"""A Flax (linen) Llama-family decoder over a paged KV cache.

One forward serves ragged prefill, decode and a mix of both: it takes a flat batch of new tokens with
their positions and cache slots, writes their K/V into the paged cache, attends over each
sequence's paged history through an attention backend (kernels_pallas), and computes logits
only at the rows asked for.

The layers are scanned (`nn.scan`) so that compile time does not grow with depth; each layer
sees the whole stacks of weights [L, ...] and takes its own by index. The KV cache rides in the
scan carry and is updated with an in-place scatter before it is read in the same layer;
scanning it as an input would make XLA copy it per step. The price of the scan: XLA:CPU copies
each layer's slice of the stacked weights before its matmuls, so every step reads and writes
the weights once more (a quarter of a batch-32 decode step's work for the default model, a
third at batch 1). Two ways out: `cpu_matmul`, a matmul that reads a layer of a stack in place
(`kernels_pallas.cpu_matmul`, for f32 or bf16 weights on CPU, stored in its panels:
`panel_kernels`; it also computes the output head tied to the embedding), or
`unroll_layers`, the layers as a
Python loop over separate per-layer weights (`unstack_layers`): no copies, and a compile time
that grows with depth (about 4x for the default model's 30 layers).

Precision: the weights are in the model's `dtype`; every matmul multiplies in that dtype and
accumulates in f32. Activations and the KV cache are in `compute_dtype(dtype, platform)`: the
weights' dtype, but f32 on CPU (see there), where bf16 weights are also stored packed
(`pack_kernels`) unless they are in the cpu matmul's panels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from checkpoints.config import ModelConfig
from jaxserve.model.rope import apply_rope, attention_factor, inverse_frequencies, rope_cos_sin
from kernels_pallas import AttentionBackend
from kernels_pallas.cpu_matmul import CpuMatmul, to_panels


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


def stacked(num_layers: int, *shape: int) -> tuple[int, ...]:
    """The shape of a parameter: a stack [num_layers, *shape] of every layer's, or one layer's (0)."""
    return (num_layers, *shape) if num_layers else shape


class RMSNorm(nn.Module):
    """`num_layers`: the scale is a stack [num_layers, D] of which the call takes `layer`'s."""

    eps: float
    dtype: Any
    num_layers: int = 0

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, stacked(self.num_layers, x.shape[-1]), jnp.float32)
        if self.num_layers:
            scale = scale[layer]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * scale).astype(self.dtype)


class DecoderLayer(nn.Module):
    """Layer `layer` of the model. `num_layers`: its parameters are stacks [num_layers, ...] of
    all the layers' (the scan); 0: its own (`unroll_layers`)."""

    config: ModelConfig
    dtype: Any  # activations and KV cache
    param_dtype: Any
    packed: bool
    backend: AttentionBackend
    num_layers: int = 0
    cpu_matmul: CpuMatmul | None = None

    @nn.compact
    def __call__(self, carry, layer, cos, sin, meta: AttentionMetadata):
        h, k_cache, v_cache = carry
        cfg = self.config
        dense = lambda feats, name, bias=False: lambda x: Linear(  # noqa: E731
            feats, bias, self.dtype, self.param_dtype, self.packed, self.num_layers, self.cpu_matmul, name=name
        )(x, layer)
        norm = lambda name: lambda x: RMSNorm(cfg.rms_norm_eps, self.dtype, self.num_layers, name=name)(x, layer)  # noqa: E731
        t = h.shape[0]
        x = norm("attn_norm")(h)
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

        x = norm("mlp_norm")(h)
        gate = dense(cfg.intermediate_size, "gate_proj")(x)
        up = dense(cfg.intermediate_size, "up_proj")(x)
        h = h + dense(cfg.hidden_size, "down_proj")(nn.silu(gate) * up)
        return (h, k_cache, v_cache), None


def compute_dtype(dtype: Any, platform: str) -> jnp.dtype:
    """The dtype of activations and of the KV cache for weights in `dtype` on `platform`: the
    weights' own, but f32 on CPU. XLA:CPU (jaxlib 0.10.2) runs a bf16 scatter or
    dynamic-update-slice by converting the whole operand to f32 and back, so a bf16 KV cache
    costs a conversion of the whole cache at every layer's write (30-100x slower steps). Its bf16
    matmuls with f32 accumulation are fast (AVX512-BF16: ~2x f32 at a prefill's shapes), so on
    CPU bf16 means bf16 weights and matmul inputs, everything else f32."""
    return jnp.dtype(jnp.float32) if platform == "cpu" else jnp.dtype(dtype)


def packs_kernels(dtype: Any, platform: str) -> bool:
    """Whether the stacked layer kernels are stored packed (`pack_kernels`): 2-byte weights on
    CPU, where XLA:CPU slices a scanned layer's bf16 weights element by element (~0.5 G
    elements/s: ~250 ms a step for the default model) but 4-byte ones at memory speed."""
    return platform == "cpu" and jnp.dtype(dtype).itemsize == 2


def pack_kernels(params: Any) -> Any:
    """The parameters with each stacked layer kernel [L, in, out] of a 2-byte dtype stored as
    uint32 pairs [L, in, out / 2] (a bitcast, no conversion); `Linear(packed=True)` reads them.
    Kernels already in a cpu matmul's panels (`panel_kernels`, more dimensions) stay as they are."""
    def pack(path, x):
        name = jax.tree_util.keystr(path)
        if "layers" not in name or not name.endswith("['kernel']") or x.dtype.itemsize != 2 or x.ndim != 3:
            return x
        if x.shape[-1] % 2:
            raise ValueError(f"cannot pack {name} of shape {x.shape}: its output features are odd")
        return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)
    return jax.tree_util.tree_map_with_path(pack, params)


def panel_kernels(params: Any, cpu_matmul: CpuMatmul) -> Any:
    """The parameters with each stacked layer kernel [L, in, out] that `cpu_matmul` takes
    stored as its panels [L, out / P, in, P]; `Linear(cpu_matmul=...)` reads them."""
    def convert(path, x):
        name = jax.tree_util.keystr(path)
        if "layers" not in name or not name.endswith("['kernel']") or not cpu_matmul.takes(x.shape[-1]):
            return x
        return to_panels(x, cpu_matmul.panel)
    return jax.tree_util.tree_map_with_path(convert, params)


def unstack_layers(tree: dict[str, Any], num_layers: int, take: Callable[[Any, int], Any]) -> dict[str, Any]:
    """A parameter tree (or a tree of its shardings) with its stacked `layers` replaced by
    `layers_0` ... `layers_{L-1}`, the layout `LlamaModel(unroll_layers=True)` takes; `take(leaf,
    i)` is layer i's part of a stacked leaf."""
    out = {name: sub for name, sub in tree.items() if name != "layers"}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda leaf: take(leaf, i), tree["layers"])
    return out


def matmul(x: jax.Array, w: jax.Array, contract_w: int = 0) -> jax.Array:
    """x [N, K] times w (K on axis `contract_w` of a 2-D w), multiplied in w's dtype and
    accumulated in f32. A single row of 2-byte weights is padded to two: XLA:CPU rewrites a
    one-row product into a multiply-reduce that converts the weights element by element
    (a batch-1 bf16 decode step ~2.5x an f32 one); the spare row costs nothing elsewhere."""
    dims = (((1,), (contract_w,)), ((), ()))
    if x.shape[0] == 1 and w.dtype.itemsize == 2:
        return lax.dot_general(jnp.pad(x, ((0, 1), (0, 0))).astype(w.dtype), w, dims,
                               preferred_element_type=jnp.float32)[:1]
    return lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=jnp.float32)


class Linear(nn.Module):
    """x @ kernel (+ bias), in the weights' dtype with f32 accumulation, returned in `dtype`.
    Parameter names are nn.Dense's. `packed`: the kernel is stored as `pack_kernels` makes it.
    `num_layers`: the parameters are stacks [num_layers, ...] of which the call takes `layer`'s,
    with `cpu_matmul(x, kernel, layer)` on a kernel stored in its panels where one is given that
    takes these features (`panel_kernels`)."""

    features: int
    use_bias: bool
    dtype: Any  # of the output
    param_dtype: Any
    packed: bool = False
    num_layers: int = 0
    cpu_matmul: CpuMatmul | None = None

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        take = (lambda p: p[layer]) if self.num_layers else (lambda p: p)  # noqa: E731
        fan_in = x.shape[-1]
        if self.num_layers and self.cpu_matmul is not None and self.cpu_matmul.takes(self.features):
            lm, shape = self.cpu_matmul, (self.num_layers, fan_in, self.features)
            init = lambda key, _, dtype: to_panels(nn.initializers.lecun_normal(batch_axis=(0,))(key, shape, dtype), lm.panel)  # noqa: E731
            y = lm(x, self.param("kernel", init, lm.stored_shape(*shape, self.param_dtype), self.param_dtype), layer)
        elif self.packed:
            words = self.param("kernel", nn.initializers.zeros, stacked(self.num_layers, fan_in, self.features // 2), jnp.uint32)
            y = matmul(x, lax.bitcast_convert_type(take(words), self.param_dtype).reshape(fan_in, self.features))
        else:
            init = nn.initializers.lecun_normal(batch_axis=(0,) if self.num_layers else ())
            kernel = self.param("kernel", init, stacked(self.num_layers, fan_in, self.features), self.param_dtype)
            y = matmul(x, take(kernel))
        if self.use_bias:
            y = y + take(self.param("bias", nn.initializers.zeros, stacked(self.num_layers, self.features), self.param_dtype))
        return y.astype(self.dtype)


class LlamaModel(nn.Module):
    """Llama / SmolLM2 / Mistral / Qwen2 decoder. Parameter tree: see checkpoints' loaders.

    `dtype` is the weights'; activations and the KV cache are in `self.compute_dtype`, both
    chosen for JAX's default platform (`compute_dtype`, `packs_kernels`).
    """

    config: ModelConfig
    backend: AttentionBackend
    dtype: Any = jnp.float32
    unroll_layers: bool = False  # per-layer weights "layers_{i}" (`unstack_layers`), not a scan
    cpu_matmul: CpuMatmul | None = None  # the scanned layers' and the tied head's: see the module docstring

    @property
    def compute_dtype(self) -> jnp.dtype:
        return compute_dtype(self.dtype, jax.default_backend())

    @property
    def packed(self) -> bool:
        """Whether its stacked layer kernels are to be given packed (`pack_kernels`)."""
        return packs_kernels(self.dtype, jax.default_backend())

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
        act = self.compute_dtype
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=act, param_dtype=self.dtype, name="embed")
        h = embed(tokens)
        cos, sin = rope_cos_sin(positions, inverse_frequencies(cfg), attention_factor(cfg))
        carry = (h, cache.k, cache.v)
        if self.unroll_layers:
            for i in range(cfg.num_layers):
                layer = DecoderLayer(cfg, act, self.dtype, self.packed, self.backend, name=f"layers_{i}")
                carry, _ = layer(carry, jnp.int32(i), cos, sin, meta)
        else:
            layers = nn.scan(
                DecoderLayer,
                variable_broadcast="params",
                split_rngs={"params": False},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
            )(cfg, act, self.dtype, self.packed, self.backend, cfg.num_layers, self.cpu_matmul, name="layers")
            carry, _ = layers(carry, jnp.arange(cfg.num_layers), cos, sin, meta)
        h, k, v = carry
        # Every row's last hidden state, for a caller that scores more rows than it samples
        # (`head_logits`); kept only when applied with mutable=["intermediates"].
        self.sow("intermediates", "hidden", h)
        h = RMSNorm(cfg.rms_norm_eps, act, name="final_norm")(h[logits_indices])
        if cfg.tie_word_embeddings and self.cpu_matmul is not None and self.cpu_matmul.takes_head(h, embed.embedding):
            logits = self.cpu_matmul.head(h, embed.embedding)
        elif cfg.tie_word_embeddings:
            logits = matmul(h, embed.embedding, contract_w=1)
        else:
            logits = Linear(cfg.vocab_size, False, jnp.float32, self.dtype, name="lm_head")(h)
        return logits, KVCache(k, v)


def final_norm(config: ModelConfig, params: Any, hidden: jax.Array) -> jax.Array:
    """The model's final norm of last hidden states (the `hidden` rows `LlamaModel` sows), with its
    parameters: what the output head reads, and what embeddings pool."""
    return RMSNorm(config.rms_norm_eps, hidden.dtype).apply({"params": params["final_norm"]}, hidden)


def head_logits(config: ModelConfig, params: Any, hidden: jax.Array) -> jax.Array:
    """f32 logits of last hidden states (the `hidden` rows `LlamaModel` sows): its final norm
    and output head, with its parameters."""
    x = final_norm(config, params, hidden)
    if config.tie_word_embeddings:
        return matmul(x, params["embed"]["embedding"], contract_w=1)
    return matmul(x, params["lm_head"]["kernel"])
