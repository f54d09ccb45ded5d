"""A decoder layer's declared weights bound to the layer being built, through which its blocks
(attention, MLP) make their projections and norms: the parameters are the layer's own
(`layers/q_proj/kernel`, ...) whichever block makes them, so blocks are plain functions and
swapping one changes no other block's parameter paths."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from checkpoints.architectures import declare
from checkpoints.config import ModelConfig
from checkpoints.quant_format import QuantFormat
from checkpoints.weights import LAYERS, Weight, flat, quantized
from jaxserve.model.linear import DeclaredParams, Linear
from jaxserve.model.lora import LoraStacks, lora_delta
from jaxserve.model.norm import RMSNorm
from kernels_pallas.cpu_matmul import CpuMatmul

Quantization = tuple[tuple[str, QuantFormat], ...]  # (kernel path, storage) of each quantized kernel


def layer_weights(
    config: ModelConfig, stacked: bool, quantization: Quantization = (), group: str = "layers"
) -> dict[str, Weight]:
    """The declared weights of a layer by name under its layer group (`layers/`, a hybrid's
    `linear_layers/` too: `checkpoints.architectures.layer_groups`), as `q_proj/kernel`, ...:
    stacked over the group's layers (the scan), or one layer's own (`unroll_layers`); quantized
    kernels as the arrays that store them (`checkpoints.weights.quantized`)."""
    declared = quantized(declare(config), dict(quantization))
    prefix = f"{group}/"
    return {
        path[len(prefix) :]: w if stacked else w.unstacked()
        for path, w in flat(declared).items()
        if path.startswith(prefix)
    }


@dataclasses.dataclass(frozen=True)
class LayerScope:
    """Layer `layer`'s weights (`layer_weights`) as its blocks use them. Its methods make Flax
    submodules, so they are called inside the layer module's `__call__` (the parent they bind to).

    dtype: of activations; packed, cpu_matmul: how the layer kernels are stored (`Linear`);
    lora, lora_slots: the adapters' LoRA slots and each row's LoRA slot (None: LoRA off)."""

    weights: dict[str, Weight]
    layer: jax.Array
    eps: float
    dtype: Any
    param_dtype: Any
    packed: bool
    cpu_matmul: CpuMatmul | None
    lora: LoraStacks | None = None
    lora_slots: jax.Array | None = None

    def dense(self, name: str, x: jax.Array) -> jax.Array:
        """x through the projection `name` (`<name>/kernel`, and `<name>/bias` where declared),
        plus each row's LoRA update where adapters target it; in `dtype`."""
        kernel, bias = self.weights[f"{name}/kernel"], self.weights.get(f"{name}/bias")
        y = Linear(kernel, bias, self.dtype, self.param_dtype, self.packed, self.cpu_matmul, name=name)(x, self.layer)
        if self.lora is None or name not in self.lora:
            return y
        update = lora_delta(x, self.lora[name]["a"], self.lora[name]["b"], self.lora_slots, self.layer)
        return (y + update).astype(y.dtype)

    def norm(self, name: str, x: jax.Array) -> jax.Array:
        """x through the RMS norm `name` (`<name>/scale`), in `dtype`."""
        return RMSNorm(self.weights[f"{name}/scale"], self.eps, self.dtype, name=name)(x, self.layer)

    def params(self, name: str) -> dict[str, jax.Array]:
        """The declared parameters `<name>/<leaf>` whole (stacks the block indexes itself), by leaf."""
        prefix = f"{name}/"
        leaves = tuple((path[len(prefix) :], w) for path, w in self.weights.items() if path.startswith(prefix))
        return DeclaredParams(leaves, self.param_dtype, name=name)()

    def stack(self, name: str, leaf: str = "kernel") -> jax.Array:
        """The declared parameter `<name>/<leaf>` whole."""
        return self.params(name)[leaf]

    def of_layer(self, array: jax.Array) -> jax.Array:
        """This layer's part of a parameter from `params`: a stack's slice, or all of a layer's
        own (`unroll_layers`)."""
        return array[self.layer] if self.stacked else array

    @property
    def stacked(self) -> bool:
        """Whether the layer's weights are stacks over the layers (the scan)."""
        return next(iter(self.weights.values())).axes[0] == LAYERS
