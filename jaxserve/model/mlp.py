"""The MLP block of a decoder layer: a gated MLP (SwiGLU / GeGLU), or a mixture of experts
(routing here, the experts' computation by the backend `jaxserve.model.experts.expert_backend`
gives, on one device or over a mesh)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from checkpoints import mxfp4
from checkpoints.config import ModelConfig
from jaxserve.model.expert_kernels import ExpertStack
from jaxserve.model.experts import activation, expert_load, route, route_grouped
from jaxserve.model.layer_scope import LayerScope


def gated_mlp(config: ModelConfig, scope: LayerScope, x: jax.Array, prefix: str = "") -> jax.Array:
    """down(act(gate(x)) * up(x)), in `scope.dtype`; `prefix` names another MLP of the layer
    (`shared_`: DeepSeek-V3's shared experts)."""
    act = activation(config.hidden_act)
    hidden = act(scope.dense(f"{prefix}gate_proj", x)) * scope.dense(f"{prefix}up_proj", x)
    return scope.dense(f"{prefix}down_proj", hidden.astype(scope.dtype))


def _kernels(params: dict[str, jax.Array]) -> ExpertStack:
    """The kernels among an expert projection's parameters: `kernel`, or its MXFP4 blocks and scales."""
    return params["kernel"] if "kernel" in params else {leaf: params[leaf] for leaf in (mxfp4.BLOCKS, mxfp4.SCALES)}


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
    (the scan); else the layer's own, given to `experts` as a stack of one.

    gpt-oss (`swiglu_limit` set): the experts take (gate_up, its bias, down), and the down
    projection's bias, weighted by each token's routing weights, is added here."""
    weights, ids = route(scope.dense("router", x), config.num_experts_per_tok, config.norm_topk_prob)
    down = scope.params("expert_down")
    if config.swiglu_limit is None:
        stacks = [scope.stack("expert_gate"), scope.stack("expert_up"), down["kernel"]]
    else:
        gate_up = scope.params("expert_gate_up")
        stacks = [_kernels(gate_up), gate_up["bias"], _kernels(down)]
    layer = scope.layer
    if not stacked:
        stacks, layer = [jax.tree.map(lambda a: a[None], s) for s in stacks], jnp.int32(0)
    out = experts(x, ids, weights, real, *stacks, layer)
    if config.swiglu_limit is not None:
        routed = jnp.where(real[:, None], weights, 0.0)  # [T, k]
        out = out + jnp.einsum("tk,tke->te", routed, scope.of_layer(down["bias"])[ids].astype(jnp.float32))
    if config.shared_expert_intermediate_size:  # Qwen3-Next: plus a shared expert, scaled by its sigmoid gate
        shared = gated_mlp(config, scope, x, "shared_")
        out = out + jax.nn.sigmoid(scope.dense("shared_expert_gate", x).astype(jnp.float32)) * shared
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
