"""The model's layers run in turn over the residual stream and the cache: scanned over stacked
weights (`nn.scan`: compile time independent of depth), unrolled over per-layer weights
(`unroll_layers`), or as the stages of a pipeline (`jaxserve.model.pipeline.PipelineLayers`).

The cache rides in the carry (h, cache) and each layer writes its tokens with an in-place scatter
before it reads them; scanning it as an input would make XLA copy it per step. Every layer is one
`DecoderLayer` kind over one cache (one layer group); a hybrid, with layers of several kinds, runs
each group's layers over its own stacks and cache (`jaxserve.model.hybrid_layers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from checkpoints.config import ModelConfig
from jaxserve.model.decoder_layer import Carry, DecoderLayer
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.layer_scope import Quantization
from jaxserve.model.lora import LoraStacks
from jaxserve.model.rope import RopeTables
from kernels_pallas import AttentionBackend
from kernels_pallas.cpu_matmul import CpuMatmul


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The options every layer is built with (`DecoderLayer`'s fields), and the three ways to run
    them. `dtype`: of activations; `param_dtype`: of the weights."""

    config: ModelConfig
    dtype: Any
    param_dtype: Any
    packed: bool
    backend: AttentionBackend
    cpu_matmul: CpuMatmul | None
    experts: Callable[..., jax.Array] | None
    quantization: Quantization

    def scanned(self, num_layers: int, length: int | None = None, **module: Any) -> nn.Module:
        """`num_layers` stacked layers as one scanned module (a child named `layers`, or unbound), scanning
        `length` of them (all by default: a run of them, `run_with_aux`, takes their indices at the call)."""
        types = self.config.layer_types  # a pipeline stage's layers are all of one kind (`stage_model_config`)
        cfg = dataclasses.replace(self.config, num_layers=num_layers, layer_types=types and types[:num_layers])
        return nn.scan(
            DecoderLayer,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=num_layers if length is None else length,
        )(*self._stacked_fields(cfg), **module)

    def layer(self, **module: Any) -> DecoderLayer:
        """One layer module with stacked weights, unbound (applied to its group's parameters:
        `jaxserve.model.hybrid_layers`); `module`: its other fields (group, attention)."""
        return DecoderLayer(*self._stacked_fields(self.config), parent=None, **module)

    def _stacked_fields(self, config: ModelConfig) -> tuple:
        """`DecoderLayer`'s positional fields for a layer of stacked weights under `config`."""
        return (
            config,
            self.dtype,
            self.param_dtype,
            self.packed,
            self.backend,
            True,
            self.cpu_matmul,
            self.experts,
            self.quantization,
        )

    def unrolled(
        self, carry: Carry, rope: RopeTables, meta: AttentionMetadata, lora: LoraStacks | None
    ) -> tuple[Carry, jax.Array]:
        """The layers as a Python loop over their own weights (children `layers_{i}` of the module
        whose `__call__` calls this), and their expert loads [L, X]."""
        loads = []
        for i in range(self.config.num_layers):
            layer = DecoderLayer(
                self.config,
                self.dtype,
                self.param_dtype,
                self.packed,
                self.backend,
                experts=self.experts,
                quantization=self.quantization,
                name=f"layers_{i}",
            )
            carry, load = layer(carry, jnp.int32(i), rope, meta, lora)
            loads.append(load)
        return carry, jnp.stack(loads)

    def run_with_aux(
        self,
        params: Any,
        carry: Carry,
        aux_layers: tuple[int, ...],
        rope: RopeTables,
        meta: AttentionMetadata,
        lora: LoraStacks | None,
    ) -> tuple[Carry, jax.Array, jax.Array]:
        """The scanned layers over their stacked weights `params` in runs that stop before each of `aux_layers`:
        (the carry after every layer, the expert loads [L, X], the residual stream entering each aux layer,
        concatenated in their order [T, len(aux_layers) * E]; vLLM's numbering: layer i's input, 0 the
        embedding). EAGLE-3 speculation reads them (`jaxserve.speculative.eagle3_model`)."""
        num_layers = self.config.num_layers
        bounds = sorted({0, num_layers, *aux_layers})
        states, loads = {}, []
        for start, stop in zip(bounds, bounds[1:]):
            states[start] = carry[0]
            layers = self.scanned(num_layers, length=stop - start, parent=None)
            carry, load = layers.apply({"params": params}, carry, jnp.arange(start, stop), rope, meta, lora)
            loads.append(load)
        return carry, jnp.concatenate(loads), jnp.concatenate([states[i] for i in aux_layers], axis=-1)

    def stage(self, params: Any, carry: Carry, rope: RopeTables, meta: AttentionMetadata) -> Carry:
        """A pipeline stage's layers: its slice [L / P, ...] of the stacked layer weights `params`
        over its slice of the cache in `carry` (every cache leaf is stacked over the layers),
        indexed from 0."""
        num_layers = jax.tree.leaves(carry[1])[0].shape[0]
        layers = self.scanned(num_layers, parent=None)
        return layers.apply({"params": params}, carry, jnp.arange(num_layers), rope, meta, None)[0]
