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
accumulates in f32. Activations are in `compute_dtype(dtype, platform)`: the weights' dtype, but
f32 on CPU (see there), where bf16 weights are also stored packed (`pack_kernels`) unless they
are in the cpu matmul's panels; a bf16 model's queries are rounded to bf16 before attention
there too. The KV cache's storage is the runner's (`--kv-cache-dtype`; by default the weights'
dtype, bf16 stored as its bits on CPU: kernels_pallas/kv_quant.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from checkpoints.architectures import declare
from checkpoints.config import ModelConfig
from checkpoints.quant_format import SCALE, QuantFormat
from checkpoints.weights import LAYERS, Weight, flat, quantized
from jaxserve.model.experts import activation, expert_backend, expert_load, route
from jaxserve.model.lora import LoraStacks, lora_delta
from jaxserve.model.quantized import QuantizedEmbed, quantized_matmul, stored_matmul
from jaxserve.model.rope import RopeTables, apply_rope, rope_tables
from kernels_pallas import AttentionBackend, kv_quant
from kernels_pallas.cpu_matmul import CpuMatmul, to_panels


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Stacked paged cache: k and v are [num_layers, num_kv_heads, num_blocks, block_size, row], a
    row being head_dim values of the storage dtype, and a scale for int8 / fp8 (`kernels_pallas.kv_quant`)."""

    k: jax.Array
    v: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @classmethod
    def zeros(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: Any) -> KVCache:
        row = kv_quant.row_width(config.head_dim, dtype)
        shape = (config.num_layers, config.num_kv_heads, num_blocks, block_size, row)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: Any) -> int:
        """Bytes of K and V of one block in a cache of storage dtype `dtype`, scales included."""
        per_token = 2 * config.num_layers * config.num_kv_heads * kv_quant.row_width(config.head_dim, dtype)
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
    lora_slots [T]: with LoRA on, each row's adapter slot (-1: the base model; see
      jaxserve/model/lora.py). None: LoRA off.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start: jax.Array | None = None
    decode_rows: jax.Array | None = None
    lora_slots: jax.Array | None = None


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
    out = backend.prefill(
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


Quantization = tuple[tuple[str, QuantFormat], ...]  # (kernel path, storage) of each quantized kernel


def layer_weights(config: ModelConfig, stacked: bool, quantization: Quantization = ()) -> dict[str, Weight]:
    """The declared weights of a layer by name under `layers/` (`q_proj/kernel`, ...): stacked
    over the layers (the scan), or one layer's own (`unroll_layers`); quantized kernels as the
    arrays that store them (`checkpoints.weights.quantized`)."""
    declared = quantized(declare(config), dict(quantization))
    return {
        path[len("layers/") :]: w if stacked else w.unstacked()
        for path, w in flat(declared).items()
        if path.startswith("layers/")
    }


def sliding_layers(config: ModelConfig) -> tuple[bool, ...]:
    """Per layer, whether it attends through the sliding window."""
    if config.sliding_window is None:
        return (False,) * config.num_layers
    if config.layer_types is None:
        return (True,) * config.num_layers
    return tuple(kind == "sliding_attention" for kind in config.layer_types)


class RMSNorm(nn.Module):
    """RMS norm with the declared scale `weight`; a stacked scale [L, D] is indexed by `layer`."""

    weight: Weight
    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        scale = self.param("scale", self.weight.flax_init(), self.weight.shape, jnp.float32)
        if self.weight.axes[0] == LAYERS:
            scale = scale[layer]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * scale).astype(self.dtype)


class DeclaredParam(nn.Module):
    """A declared parameter read whole (the stacked expert weights, which `ExpertBackend`
    indexes by layer and expert itself); its path is `<name>/kernel`."""

    weight: Weight
    param_dtype: Any

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", self.weight.flax_init(), self.weight.shape, self.param_dtype)


class DecoderLayer(nn.Module):
    """Layer `layer` of the model: Llama's, with the blocks its family switches on (q/k norms,
    post norms, GeGLU, sliding or interleaved local/global attention, mixture of experts).
    `stacked`: its parameters are stacks [num_layers, ...] of all the layers' (the scan); else
    its own (`unroll_layers`). Returns the carry and the layer's expert load ([X], or [0])."""

    config: ModelConfig
    dtype: Any  # activations and KV cache
    param_dtype: Any
    packed: bool
    backend: AttentionBackend
    stacked: bool = False
    cpu_matmul: CpuMatmul | None = None
    experts: Callable[..., jax.Array] | None = None  # the mixture-of-experts backend (`LlamaModel.experts`)
    quantization: Quantization = ()

    @nn.compact
    def __call__(self, carry, layer, rope: RopeTables, meta: AttentionMetadata, lora: LoraStacks | None = None):
        h, k_cache, v_cache = carry
        cfg = self.config
        w = layer_weights(cfg, self.stacked, self.quantization)
        cpu_matmul = self.cpu_matmul if self.stacked else None

        def dense(name):
            def project(x):
                y = Linear(
                    w[f"{name}/kernel"],
                    w.get(f"{name}/bias"),
                    self.dtype,
                    self.param_dtype,
                    self.packed,
                    cpu_matmul,
                    name=name,
                )(x, layer)
                if lora is None or name not in lora:
                    return y
                return (y + lora_delta(x, lora[name]["a"], lora[name]["b"], meta.lora_slots, layer)).astype(y.dtype)

            return project

        norm = lambda name: (
            lambda x: RMSNorm(  # noqa: E731
                w[f"{name}/scale"], cfg.rms_norm_eps, self.dtype, name=name
            )(x, layer)
        )
        t = h.shape[0]
        x = norm("attn_norm")(h)
        q = dense("q_proj")(x).reshape(t, cfg.num_heads, cfg.head_dim)
        k = dense("k_proj")(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = dense("v_proj")(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = norm("q_norm")(q), norm("k_norm")(k)
        sliding = sliding_layers(cfg)
        is_sliding = jnp.asarray(sliding)[layer]
        cos, sin = rope.select(is_sliding)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        block_size = k_cache.shape[3]
        blocks, offsets = meta.slot_mapping // block_size, meta.slot_mapping % block_size
        k_cache = k_cache.at[layer, :, blocks, offsets].set(kv_quant.quantize(k, k_cache.dtype))
        v_cache = v_cache.at[layer, :, blocks, offsets].set(kv_quant.quantize(v, v_cache.dtype))

        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        if jnp.dtype(self.param_dtype) == jnp.bfloat16:
            # A bf16 model's queries are bf16 (on CPU, where activations are f32, the matmuls round
            # them to bf16 pairs anyway): its prefill attention then multiplies bf16 pairs too.
            q = q.astype(jnp.bfloat16)
        attend = lambda window: (
            lambda: paged_attention(  # noqa: E731
                self.backend, q, k_cache, v_cache, layer, meta, scale=scale, sliding_window=window
            )
        )
        if all(sliding) or not any(sliding):
            attn = attend(cfg.sliding_window if all(sliding) else None)()
        else:  # interleaved local and global layers: each kind's kernels, the layer's taken
            attn = lax.cond(is_sliding, attend(cfg.sliding_window), attend(None))
        out = dense("o_proj")(attn.reshape(t, -1).astype(self.dtype))
        h = h + (norm("post_attn_norm")(out) if cfg.post_norms else out)

        x = norm("mlp_norm")(h)
        if cfg.num_experts:
            out, load = self._experts(x, layer, w, dense, meta, block_size)
        else:
            act = activation(cfg.hidden_act)
            out = dense("down_proj")((act(dense("gate_proj")(x)) * dense("up_proj")(x)).astype(self.dtype))
            load = jnp.zeros(0, jnp.int32)
        h = h + (norm("post_mlp_norm")(out) if cfg.post_norms else out)
        return (h, k_cache, v_cache), load

    def _experts(self, x, layer, w, dense, meta: AttentionMetadata, block_size: int):
        """The mixture-of-experts MLP of `x`, and the layer's expert load. Padding rows (their
        slots in block 0, never allocated) are routed nowhere and not counted."""
        cfg = self.config
        weights, ids = route(dense("router")(x), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        real = meta.slot_mapping >= block_size
        stack = lambda name: DeclaredParam(w[f"{name}/kernel"], self.param_dtype, name=name)()  # noqa: E731
        gate, up, down = stack("expert_gate"), stack("expert_up"), stack("expert_down")
        if not self.stacked:  # one layer's own weights: a stack of one
            gate, up, down, layer = gate[None], up[None], down[None], jnp.int32(0)
        out = self.experts(x, ids, weights, real, gate, up, down, layer)
        return out.astype(self.dtype), expert_load(ids, real, cfg.num_experts)


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
    Kernels already in a cpu matmul's panels (`panel_kernels`, more dimensions) and expert kernels
    [L, X, in, out] (the experts' grouped matmuls read them) stay as they are."""

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
    stored as its panels [L, out / P, in, P] (a quantized kernel's codes and scales each so),
    and a quantized output head's arrays [rows, V] as a stack of one [1, V / P, rows, P];
    `Linear(cpu_matmul=...)` and `QuantizedEmbed` read them."""

    def convert(path, x):
        name = jax.tree_util.keystr(path)
        quantized = (
            name.endswith(("['kernel_scale']", "['kernel_min']"))  # beside quantized codes
            or (name.endswith("['kernel']") and jnp.issubdtype(x.dtype, jnp.integer))
        )
        if x.ndim not in (2, 3) or not cpu_matmul.takes(x.shape[-1]):
            return x
        if "layers" in name and x.ndim == 3 and (quantized or name.endswith("['kernel']")):
            return to_panels(x, cpu_matmul.panel)
        if "layers" not in name and x.ndim == 2 and quantized:
            return to_panels(x[None], cpu_matmul.panel)
        return x

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
        return lax.dot_general(
            jnp.pad(x, ((0, 1), (0, 0))).astype(w.dtype), w, dims, preferred_element_type=jnp.float32
        )[:1]
    return lax.dot_general(x.astype(w.dtype), w, dims, preferred_element_type=jnp.float32)


class Linear(nn.Module):
    """x @ kernel (+ bias), in the weights' dtype with f32 accumulation, returned in `dtype`.
    Parameter names are nn.Dense's; shapes come from the declared `kernel` and `bias`. `packed`:
    the kernel is stored as `pack_kernels` makes it. A stacked kernel [L, in, out] (and bias) is
    indexed by `layer`, with `cpu_matmul(x, kernel, layer)` on a kernel stored in its panels where
    one is given that takes these features (`panel_kernels`). A quantized kernel (the declared
    codes' `quant`) is read by `quantized_matmul`."""

    kernel: Weight
    bias: Weight | None
    dtype: Any  # of the output
    param_dtype: Any
    packed: bool = False
    cpu_matmul: CpuMatmul | None = None

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array | None = None) -> jax.Array:
        stacked = self.kernel.axes[0] == LAYERS
        take = (lambda p: p[layer]) if stacked else (lambda p: p)  # noqa: E731
        shape = self.kernel.shape
        fan_in, features = shape[-2:]
        if self.kernel.quant is not None:
            y = quantized_matmul(self, self.kernel, x, layer, self.param_dtype, self.cpu_matmul)
        elif stacked and self.cpu_matmul is not None and self.cpu_matmul.takes(features):
            lm, init = self.cpu_matmul, self.kernel.flax_init()
            panels = lambda key, _, dtype: to_panels(init(key, shape, dtype), lm.panel)  # noqa: E731
            y = lm(x, self.param("kernel", panels, lm.stored_shape(*shape, self.param_dtype), self.param_dtype), layer)
        elif self.packed:
            words = self.param("kernel", nn.initializers.zeros, (*shape[:-1], features // 2), jnp.uint32)
            y = matmul(x, lax.bitcast_convert_type(take(words), self.param_dtype).reshape(fan_in, features))
        else:
            kernel = self.param("kernel", self.kernel.flax_init(), shape, self.param_dtype)
            y = matmul(x, take(kernel))
        if self.bias is not None:
            y = y + take(self.param("bias", self.bias.flax_init(), self.bias.shape, self.param_dtype))
        return y.astype(self.dtype)


class LlamaModel(nn.Module):
    """The decoder of every family in `checkpoints/architectures/` (Llama-shaped, with the blocks
    each family switches on: see `DecoderLayer`). Parameter shapes come from the architecture's
    declared weights (`checkpoints.weights`).

    `dtype` is the weights'; activations and the KV cache are in `self.compute_dtype`, both
    chosen for JAX's default platform (`compute_dtype`, `packs_kernels`). `experts` computes the
    mixture-of-experts MLPs (`jaxserve.model.experts.expert_backend`: on one device by default,
    over a mesh's `ep` and `tp` axes when the runner gives it one).
    """

    config: ModelConfig
    backend: AttentionBackend
    dtype: Any = jnp.float32
    unroll_layers: bool = False  # per-layer weights "layers_{i}" (`unstack_layers`), not a scan
    cpu_matmul: CpuMatmul | None = None  # the scanned layers' and the tied head's: see the module docstring
    experts: Callable[..., jax.Array] | None = None
    quantization: Quantization = ()  # the quantized kernels (`checkpoints.quantize.formats_of` the parameters)
    # Pipeline parallel: runs the scanned layers as stages of a mesh's `pp` axis
    # (`jaxserve.model.pipeline.PipelineLayers`); the stacked layer weights and cache are split over it.
    pipeline: Callable[..., tuple] | None = None

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
        lora: LoraStacks | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """tokens, positions [T] -> (f32 logits [N, vocab] at rows logits_indices [N], new cache).
        Indices of -1 are padding rows after the live ones (their logits are not used: zeros on
        the C++ head, else the last row's). `lora`: the adapters' device slots
        (jaxserve/model/lora.py), read at `meta.lora_slots`."""
        cfg = self.config
        act = self.compute_dtype
        weights = flat(quantized(declare(cfg), dict(self.quantization)))
        experts = self.experts or (expert_backend(cfg) if cfg.num_experts else None)
        if "embed/kernel" in weights:  # a tied table stored quantized as the head's kernel
            embed = QuantizedEmbed(weights["embed/kernel"], act, self.dtype, self.cpu_matmul, name="embed")
        else:
            embed = nn.Embed(
                cfg.vocab_size,
                cfg.hidden_size,
                dtype=act,
                param_dtype=self.dtype,
                embedding_init=weights["embed/embedding"].flax_init(),
                name="embed",
            )
        h = embed(tokens)
        if cfg.scale_embeddings:  # by sqrt(hidden) rounded to the weights' dtype, as Gemma does
            h = h * jnp.asarray(cfg.hidden_size**0.5, self.dtype).astype(act)
        rope = rope_tables(cfg, positions)
        carry = (h, cache.k, cache.v)
        if self.unroll_layers:
            loads = []
            for i in range(cfg.num_layers):
                layer = DecoderLayer(
                    cfg,
                    act,
                    self.dtype,
                    self.packed,
                    self.backend,
                    experts=experts,
                    quantization=self.quantization,
                    name=f"layers_{i}",
                )
                carry, load = layer(carry, jnp.int32(i), rope, meta, lora)
                loads.append(load)
            load = jnp.stack(loads)
        elif self.pipeline is not None and not self.is_initializing():
            carry, ticks = self.pipeline(self._stage_layers, self.variables["params"]["layers"], carry, rope, meta)
            self.sow("intermediates", "pipeline_ticks", ticks)  # which micro-batch each stage ran per tick
            load = jnp.zeros((cfg.num_layers, 0), jnp.int32)
        else:
            layers = self._scanned_layers(cfg.num_layers, experts, name="layers")
            carry, load = layers(carry, jnp.arange(cfg.num_layers), rope, meta, lora)
        h, k, v = carry
        # Every row's last hidden state, for a caller that scores more rows than it samples
        # (`head_logits`), and each layer's assignments per expert [L, X] (mixture of experts);
        # kept only when applied with mutable=["intermediates"].
        self.sow("intermediates", "hidden", h)
        if cfg.num_experts:
            self.sow("intermediates", "expert_load", load)
        h = RMSNorm(weights["final_norm/scale"], cfg.rms_norm_eps, act, name="final_norm")(h[logits_indices])
        if isinstance(embed, QuantizedEmbed):
            logits = embed.attend(h)
        elif cfg.tie_word_embeddings and self.cpu_matmul is not None and self.cpu_matmul.takes_head(h, embed.embedding):
            # Padding rows (index -1, after the live ones: `ModelInputs.prefill`) are not computed.
            logits = self.cpu_matmul.head(h, embed.embedding, jnp.sum(logits_indices >= 0))
        elif cfg.tie_word_embeddings:
            logits = matmul(h, embed.embedding, contract_w=1)
        else:  # a quantized head on the C++ kernel where one is given (in panels: `panel_kernels`)
            logits = Linear(
                weights["lm_head/kernel"], None, jnp.float32, self.dtype, cpu_matmul=self.cpu_matmul, name="lm_head"
            )(h)
        return logits, KVCache(k, v)

    def _scanned_layers(self, num_layers: int, experts: Callable[..., jax.Array] | None, **module: Any) -> nn.Module:
        """`num_layers` stacked layers as one scanned module (a child named `layers`, or unbound)."""
        types = self.config.layer_types  # a pipeline stage's layers are all of one kind (`stage_model_config`)
        cfg = dataclasses.replace(self.config, num_layers=num_layers, layer_types=types and types[:num_layers])
        return nn.scan(
            DecoderLayer,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=num_layers,
        )(
            cfg,
            self.compute_dtype,
            self.dtype,
            self.packed,
            self.backend,
            True,
            self.cpu_matmul,
            experts,
            self.quantization,
            **module,
        )

    def _stage_layers(self, params: Any, carry: tuple, rope: RopeTables, meta: AttentionMetadata) -> tuple:
        """A pipeline stage's layers: its slice [L / P, ...] of the stacked layer weights `params`
        over its slice of the cache in `carry` (h, k, v), indexed from 0."""
        num_layers = carry[1].shape[0]
        layers = self._scanned_layers(num_layers, None, parent=None)
        return layers.apply({"params": params}, carry, jnp.arange(num_layers), rope, meta, None)[0]


def final_norm(config: ModelConfig, params: Any, hidden: jax.Array) -> jax.Array:
    """The model's final norm of last hidden states (the `hidden` rows `LlamaModel` sows), with its
    parameters: what the output head reads, and what embeddings pool."""
    norm = RMSNorm(flat(declare(config))["final_norm/scale"], config.rms_norm_eps, hidden.dtype)
    return norm.apply({"params": params["final_norm"]}, hidden)


def head_logits(config: ModelConfig, params: Any, hidden: jax.Array) -> jax.Array:
    """f32 logits of last hidden states (the `hidden` rows `LlamaModel` sows): its final norm
    and output head, with its parameters."""
    x = final_norm(config, params, hidden)
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    if SCALE in head:  # quantized (`--quantization`)
        return stored_matmul(x, head, None, x.dtype)
    if config.tie_word_embeddings:
        return matmul(x, head["embedding"], contract_w=1)
    return matmul(x, head["kernel"])
