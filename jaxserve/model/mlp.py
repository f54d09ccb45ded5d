"""The MLP block of a decoder layer: a gated MLP (SwiGLU / GeGLU), or a mixture of experts
(routing here, the experts' computation by the backend `jaxserve.model.experts.expert_backend`
gives, on one device or over a mesh)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from checkpoints.config import ModelConfig
from jaxserve.model.experts import activation, expert_load, route
from jaxserve.model.layer_scope import LayerScope


def gated_mlp(config: ModelConfig, scope: LayerScope, x: jax.Array) -> jax.Array:
    """down(act(gate(x)) * up(x)), in `scope.dtype`."""
    act = activation(config.hidden_act)
    return scope.dense("down_proj", (act(scope.dense("gate_proj", x)) * scope.dense("up_proj", x)).astype(scope.dtype))


def mixture_of_experts(
    config: ModelConfig,
    scope: LayerScope,
    x: jax.Array,
    real: jax.Array,
    experts: Callable[..., jax.Array],
    stacked: bool,
) -> tuple[jax.Array, jax.Array]:
    """The mixture-of-experts MLP of `x` through `experts` (its computation over the stacked
    expert weights), and the layer's load [X] (assignments per expert). Padding rows (`real`
    false) are routed nowhere and not counted. `stacked`: the weights are stacks over the layers
    (the scan); else the layer's own, given to `experts` as a stack of one."""
    weights, ids = route(scope.dense("router", x), config.num_experts_per_tok, config.norm_topk_prob)
    gate, up, down = scope.stack("expert_gate"), scope.stack("expert_up"), scope.stack("expert_down")
    layer = scope.layer
    if not stacked:
        gate, up, down, layer = gate[None], up[None], down[None], jnp.int32(0)
    out = experts(x, ids, weights, real, gate, up, down, layer)
    if config.shared_expert_intermediate_size:  # Qwen3-Next: plus a shared expert, scaled by its sigmoid gate
        act = activation(config.hidden_act)
        shared = act(scope.dense("shared_gate_proj", x)) * scope.dense("shared_up_proj", x)
        shared = scope.dense("shared_down_proj", shared.astype(scope.dtype))
        out = out + jax.nn.sigmoid(scope.dense("shared_expert_gate", x).astype(jnp.float32)) * shared
    return out.astype(scope.dtype), expert_load(ids, real, config.num_experts)
