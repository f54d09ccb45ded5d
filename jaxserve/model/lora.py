"""LoRA adapters as fixed-shape LoRA slots, applied per row inside the projections.

A runner with LoRA on holds, for each projection an adapter may target, the stacked A and B of
every LoRA slot: A [L, in, S, r] and B [L, S, r, out] (S LoRA slots, rank r = the largest rank
served; an adapter of a smaller rank is zero-padded, and its scaling, lora_alpha / r or
lora_alpha / sqrt(r) for rsLoRA, is folded into B). Each row of a step names its LoRA slot
(`AttentionMetadata.lora_slots`; -1: the base model), and a projection adds

    y[t] += (x[t] @ A[layer, :, lora_slot[t]]) @ B[layer, lora_slot[t]]

computed for all rows at once without gathering per-row weights: x @ A[layer] as one matmul
[T, in] x [in, S * r], the columns of other LoRA slots masked to zero per row, then one matmul with
B[layer] as [S * r, out]. Its cost is that of a rank-(S * r) update whatever the batch's mix of
adapters, its shapes never change when adapters come and go (no compilation), and under tensor
parallelism A and B split like their base projection (A over `in` for the row-parallel o/down
projections, B over `out` for the column-parallel others), so the update needs no
communication of its own beyond the base projection's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The projections an adapter may target, by the names of this model's parameters (PEFT's
# target_modules use the same names for Llama-family models).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Those whose base kernel is split over its input features under tensor parallelism.
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})

LoraStacks = dict[str, dict[str, jax.Array]]  # module -> {"a": [L, in, S, r], "b": [L, S, r, out]}


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, lora_slots: jax.Array, layer: jax.Array) -> jax.Array:
    """f32 [T, out]: each row's low-rank update from its LoRA slot's adapter (zeros for LoRA slot -1).
    x [T, in]; a [L, in, S, r]; b [L, S, r, out]; lora_slots [T] int32."""
    _, fan_in, num_lora_slots, rank = a.shape
    features = b.shape[-1]
    t = x.shape[0]
    xa = jnp.dot(x.astype(a.dtype), a[layer].reshape(fan_in, num_lora_slots * rank), preferred_element_type=jnp.float32)
    mask = jax.nn.one_hot(lora_slots, num_lora_slots, dtype=jnp.float32)  # LoRA slot -1: a row of zeros
    xa = (xa.reshape(t, num_lora_slots, rank) * mask[:, :, None]).reshape(t, num_lora_slots * rank)
    return jnp.dot(
        xa.astype(b.dtype), b[layer].reshape(num_lora_slots * rank, features), preferred_element_type=jnp.float32
    )
