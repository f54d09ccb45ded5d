"""The runner's LoRA slots: the stacked A and B arrays every step reads
(jaxserve/model/lora.py), where they lie on the mesh, and the arguments of the program that
writes one adapter into one LoRA slot (`lora_write`, compiled once at warm-up: LoRA slots change without
compiling anything).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoints.config import ModelConfig
from jaxserve.lora.peft import LoraWeights, module_shapes
from jaxserve.model.lora import LORA_MODULES, LoraStacks


def write_adapter(stacks: LoraStacks, lora_slot: jax.Array, adapter: LoraStacks) -> LoraStacks:
    """`stacks` with LoRA slot `lora_slot` (a device scalar) holding `adapter` (per module a [L, in, r],
    b [L, r, out])."""

    def put(module: str) -> dict[str, jax.Array]:
        a, b = stacks[module]["a"], stacks[module]["b"]
        new_a, new_b = adapter[module]["a"][:, :, None], adapter[module]["b"][:, None]
        return {
            "a": jax.lax.dynamic_update_slice(a, new_a.astype(a.dtype), (0, 0, lora_slot, 0)),
            "b": jax.lax.dynamic_update_slice(b, new_b.astype(b.dtype), (0, lora_slot, 0, 0)),
        }

    return {module: put(module) for module in stacks}


class LoraSlots:
    """Shapes and shardings of a runner's LoRA slots. `config` is the model as checkpointed (an
    adapter's k/v projections are repeated like the base ones where tensor parallelism serves
    `kv_replicas` copies of each kv head); `kernel_specs` are the stacked base kernels' partition
    specs [L, in, out] by module, which A (over `in`) and B (over `out`) follow."""

    def __init__(
        self,
        config: ModelConfig,
        num_lora_slots: int,
        rank: int,
        dtype: Any,
        mesh: Mesh,
        kernel_specs: dict[str, P],
        kv_replicas: int,
    ) -> None:
        self.config, self.num_lora_slots, self.rank, self.dtype = config, num_lora_slots, rank, jnp.dtype(dtype)
        self.kv_replicas = kv_replicas
        layers = config.num_layers
        self.shapes = {
            m: (fan_in, features * (kv_replicas if m in ("k_proj", "v_proj") else 1))
            for m, (fan_in, features) in module_shapes(config).items()
            if m in LORA_MODULES
        }
        self.stack_shapes = {
            m: {"a": (layers, fan_in, num_lora_slots, rank), "b": (layers, num_lora_slots, rank, out)}
            for m, (fan_in, out) in self.shapes.items()
        }

        def spec(module: str, axis: int) -> Any:  # the base kernel's split of its `in` (1) or `out` (2) axis
            s = tuple(kernel_specs.get(module, P()))
            return s[axis] if len(s) > axis else None

        self.shardings = {
            m: {
                "a": NamedSharding(mesh, P(None, spec(m, 1), None, None)),
                "b": NamedSharding(mesh, P(None, None, None, spec(m, 2))),
            }
            for m in self.shapes
        }
        self.adapter_shardings = {
            m: {
                "a": NamedSharding(mesh, P(None, spec(m, 1), None)),
                "b": NamedSharding(mesh, P(None, None, spec(m, 2))),
            }
            for m in self.shapes
        }

    def zeros(self) -> LoraStacks:
        """Empty LoRA slots, placed."""
        return {
            m: {k: jax.device_put(np.zeros(shape, self.dtype), self.shardings[m][k]) for k, shape in s.items()}
            for m, s in self.stack_shapes.items()
        }

    def adapter_arrays(self, weights: LoraWeights | None) -> LoraStacks:
        """One adapter's A [L, in, r] and B [L, r, out] per module, as numpy in the LoRA slots' dtype
        (zeros for the modules it does not target; None: all zeros)."""
        layers, out = self.config.num_layers, {}
        for m, (fan_in, features) in self.shapes.items():
            if weights is not None and m in weights.modules:
                a, b = weights.modules[m]
                if self.kv_replicas > 1 and m in ("k_proj", "v_proj"):
                    heads = b.reshape(layers, self.rank, self.config.num_kv_heads, self.config.head_dim)
                    b = np.repeat(heads, self.kv_replicas, axis=2).reshape(layers, self.rank, features)
            else:
                a, b = np.zeros((layers, fan_in, self.rank)), np.zeros((layers, self.rank, features))
            out[m] = {"a": np.asarray(a, self.dtype), "b": np.asarray(b, self.dtype)}
        return out

    @property
    def bytes_per_lora_slot(self) -> int:
        return (
            sum(
                int(np.prod(s)) // self.num_lora_slots for shapes in self.stack_shapes.values() for s in shapes.values()
            )
            * self.dtype.itemsize
        )
