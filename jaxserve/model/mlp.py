"""The MLP block of a decoder layer: a gated MLP (SwiGLU / GeGLU), or a mixture of experts
(routing here, the experts' computation by the backend `jaxserve.model.experts.expert_backend`
gives, on one device or over a mesh)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from checkpoints.config import ModelConfig
from jaxserve.model.experts import activation, expert_load, route, route_grouped
from jaxserve.model.layer_scope import LayerScope


def gated_mlp(config: ModelConfig, scope: LayerScope, x: jax.Array, prefix: str = "") -> jax.Array:
    """down(act(gate(x)) * up(x)), in `scope.dtype`; `prefix` names another MLP of the layer
    (`shared_`: DeepSeek-V3's shared experts)."""
    act = activation(config.hidden_act)
    hidden = act(scope.dense(f"{prefix}gate_proj", x)) * scope.dense(f"{prefix}up_proj", x)
    return scope.dense(f"{prefix}down_proj", hidden.astype(scope.dtype))


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
    return out.astype(scope.dtype), expert_load(ids, real, config.num_experts)


def dense_then_shared_experts(
    config: ModelConfig, scope: LayerScope, x: jax.Array, real: jax.Array, experts: Callable[..., jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's MLP of a scanned layer and its load [X]: the first `first_k_dense_replace`
    layers' dense gated MLP (no load), the others' routed experts (`route_grouped`) plus shared
    experts; each kind's weights are a stack of its own layers, so the layer index is shifted
    into it, and a `lax.cond` on the layer runs the one kind."""
    first_moe, num_experts = config.first_k_dense_replace, config.num_experts

    def dense() -> tuple[jax.Array, jax.Array]:
        layer = jnp.minimum(scope.layer, first_moe - 1)
        return gated_mlp(config, dataclasses.replace(scope, layer=layer), x), jnp.zeros(num_experts, jnp.int32)

    def moe() -> tuple[jax.Array, jax.Array]:
        s = dataclasses.replace(scope, layer=jnp.maximum(scope.layer - first_moe, 0))
        correction = s.stack("expert_bias", "bias")[s.layer]
        weights, ids = route_grouped(
            s.dense("router", x),
            correction,
            config.num_experts_per_tok,
            config.n_group,
            config.topk_group,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        )
        gate, up, down = s.stack("expert_gate"), s.stack("expert_up"), s.stack("expert_down")
        routed = experts(x, ids, weights, real, gate, up, down, s.layer)
        out = routed + gated_mlp(config, s, x, "shared_").astype(jnp.float32)
        return out.astype(scope.dtype), expert_load(ids, real, num_experts)

    if first_moe == 0:
        return moe()
    if first_moe >= config.num_layers:
        return dense()
    return lax.cond(scope.layer < first_moe, dense, moe)
