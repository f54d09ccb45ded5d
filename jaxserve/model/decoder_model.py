"""The decoder model: token embedding, the layers over a paged KV cache, final norm and output
head, for every family in `checkpoints/architectures/` (their differences are the config's
switches and the declared weights; see `DecoderLayer`).

One forward serves ragged prefill, decode and a mix of both: it takes a flat batch of new tokens
with their positions and KV slots, writes their K/V into the paged cache, attends over each
sequence's paged history through an attention backend (kernels_pallas), and computes logits
only at the rows asked for.

The layers are scanned (`LayerStack.scanned`) so that compile time does not grow with depth;
each layer sees the whole stacks of weights [L, ...] and takes its own by index. The price of
the scan: XLA:CPU copies each layer's slice of the stacked weights before its matmuls, so every
step reads and writes the weights once more (a quarter of a batch-32 decode step's work for the
default model, a third at batch 1). Two ways out: `cpu_matmul`, a matmul that reads a layer of a
stack in place (`kernels_pallas.cpu_matmul`, for f32 or bf16 weights on CPU, stored in its
panels: `panel_kernels`; it also computes the output head tied to the embedding), or
`unroll_layers`, the layers as a Python loop over separate per-layer weights (`unstack_layers`):
no copies, and a compile time that grows with depth (about 4x for the default model's 30 layers).

Precision: the weights are in the model's `dtype`; every matmul multiplies in that dtype and
accumulates in f32. Activations are in `compute_dtype(dtype, platform)`: the weights' dtype, but
f32 on CPU (see there), where bf16 weights are also stored packed (`pack_kernels`) unless they
are in the cpu matmul's panels; a bf16 model's queries are rounded to bf16 before attention
there too. The KV cache's storage is the runner's (`--kv-cache-dtype`; by default the weights'
dtype, bf16 stored as its bits on CPU: kernels_pallas/kv_quant.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from checkpoints.architectures import declare
from checkpoints.architectures.layer_groups import is_hybrid
from checkpoints.config import ModelConfig
from checkpoints.weights import flat, quantized
from jaxserve.model.decoder_layer import Carry
from jaxserve.model.experts import expert_backend
from jaxserve.model.head import embedding, output_head
from jaxserve.model.hybrid_layers import HybridLayers
from jaxserve.model.image_rows import ImageRows
from jaxserve.model.kv_cache import AttentionMetadata, KVCache
from jaxserve.model.layer_scope import Quantization
from jaxserve.model.layer_stack import LayerStack
from jaxserve.model.layout import compute_dtype, packs_kernels
from jaxserve.model.lora import LoraStacks
from jaxserve.model.norm import RMSNorm
from jaxserve.model.rope import RopeTables, rope_tables
from jaxserve.model.state_cache import ModelCaches
from kernels_pallas import AttentionBackend
from kernels_pallas.cpu_matmul import CpuMatmul


class DecoderModel(nn.Module):
    """The decoder of every family in `checkpoints/architectures/`. Parameter shapes come from the
    architecture's declared weights (`checkpoints.weights`).

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
    # EAGLE-3 speculation: the residual stream entering these layers is sown too ("aux_hidden", [T, A * E];
    # `LayerStack.run_with_aux`); () for every other use (the layers run as one scan).
    aux_layers: tuple[int, ...] = ()

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
        cache: KVCache | ModelCaches,
        meta: AttentionMetadata,
        logits_indices: jax.Array,
        lora: LoraStacks | None = None,
        images: ImageRows | None = None,
    ) -> tuple[jax.Array, KVCache | ModelCaches]:
        """tokens, positions [T] -> (f32 logits [N, vocab] at rows logits_indices [N], new cache).
        `cache`: the paged KV cache, or a hybrid's caches of its layer groups (`ModelCaches`).
        Indices of -1 are padding rows after the live ones (their logits are not used: zeros on
        the C++ head, else the last row's). `lora`: the adapters' LoRA slots
        (jaxserve/model/lora.py), read at `meta.lora_slots`. `images`: rows whose input is an
        image's soft-token embedding rather than their token's."""
        cfg, act = self.config, self.compute_dtype
        weights = flat(quantized(declare(cfg), dict(self.quantization)))
        embed = embedding(cfg, weights, act, self.dtype, self.cpu_matmul)
        h = embed(tokens)
        if cfg.scale_embeddings:  # by sqrt(hidden) rounded to the weights' dtype, as Gemma does
            h = h * jnp.asarray(cfg.hidden_size**0.5, self.dtype).astype(act)
        if images is not None:
            h = images.merge(h)
        (h, cache), load = self._layers((h, cache), rope_tables(cfg, positions), meta, lora)
        # Every row's last hidden state, for a caller that scores more rows than it samples
        # (`head_logits`), and each layer's assignments per expert [L, X] (mixture of experts);
        # kept only when applied with mutable=["intermediates"].
        self.sow("intermediates", "hidden", h)
        if cfg.num_experts:
            self.sow("intermediates", "expert_load", load)
        h = RMSNorm(weights["final_norm/scale"], cfg.rms_norm_eps, act, name="final_norm")(h[logits_indices])
        return output_head(cfg, weights, embed, h, logits_indices, self.dtype, self.cpu_matmul), cache

    def _layers(
        self, carry: Carry, rope: RopeTables, meta: AttentionMetadata, lora: LoraStacks | None
    ) -> tuple[Carry, jax.Array]:
        """The carry (h, cache) after every layer, and the layers' expert loads [L, X]."""
        cfg = self.config
        experts = self.experts or (expert_backend(cfg) if cfg.num_experts else None)
        stack = LayerStack(
            cfg, self.compute_dtype, self.dtype, self.packed, self.backend, self.cpu_matmul, experts, self.quantization
        )
        if is_hybrid(cfg):  # layer groups of several kinds, each with its stacks and cache
            return HybridLayers(stack)(self.variables["params"], carry, rope, meta)
        if self.unroll_layers:
            return stack.unrolled(carry, rope, meta, lora)
        if self.aux_layers and not self.is_initializing():
            carry, load, aux = stack.run_with_aux(
                self.variables["params"]["layers"], carry, self.aux_layers, rope, meta, lora
            )
            self.sow("intermediates", "aux_hidden", aux)
            return carry, load
        if self.pipeline is not None and not self.is_initializing():
            carry, ticks = self.pipeline(stack.stage, self.variables["params"]["layers"], carry, rope, meta)
            self.sow("intermediates", "pipeline_ticks", ticks)  # which micro-batch each stage ran per tick
            return carry, jnp.zeros((cfg.num_layers, 0), jnp.int32)
        return stack.scanned(cfg.num_layers, name="layers")(carry, jnp.arange(cfg.num_layers), rope, meta, lora)
