"""A hybrid's layers (Gated DeltaNet and full attention, `layer_groups`): each layer group has its
own stacked weights (`linear_layers/...`, `layers/...`) and its own cache in the model's caches
(`ModelCaches`: the states by state slot, the paged KV cache), and the layers run in the model's
order as one scan over the period of their kinds (Qwen3.5: three Gated DeltaNet layers then one
full attention): compile time independent of depth, each layer taking its weights from its
group's stacks by its index in the group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from checkpoints.architectures.layer_groups import LINEAR_ATTENTION, layer_groups, layer_period
from jaxserve.model.attention import PagedAttention
from jaxserve.model.decoder_layer import Carry
from jaxserve.model.gated_deltanet import GatedDeltaNet
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.layer_stack import LayerStack
from jaxserve.model.rope import RopeTables
from jaxserve.model.state_cache import ModelCaches

ATTENTION_KINDS = {LINEAR_ATTENTION: GatedDeltaNet}  # other groups: `PagedAttention`


def _group_cache(caches: ModelCaches, kind: str) -> Any:
    return caches.state if kind == LINEAR_ATTENTION else caches.paged


def _with_group_cache(caches: ModelCaches, kind: str, cache: Any) -> ModelCaches:
    field = "state" if kind == LINEAR_ATTENTION else "paged"
    return dataclasses.replace(caches, **{field: cache})


@dataclasses.dataclass(frozen=True)
class HybridLayers:
    """The layers of a model with several layer groups, built with `stack`'s options."""

    stack: LayerStack

    def __call__(self, params: Any, carry: Carry, rope: RopeTables, meta: AttentionMetadata) -> tuple[Carry, jax.Array]:
        """The carry (h, ModelCaches) after every layer, and the layers' expert loads [L, X] (X = 0
        without experts); `params`: the model's (every group's stacks)."""
        cfg = self.stack.config
        groups = {g.kind: g for g in layer_groups(cfg)}
        period = layer_period(cfg)
        pattern = cfg.layer_types[:period]
        layers = {
            kind: self.stack.layer(group=g.name, attention=ATTENTION_KINDS.get(kind, PagedAttention))
            for kind, g in groups.items()
        }

        def one_period(carry: Carry, index: jax.Array) -> tuple[Carry, jax.Array]:
            h, caches = carry
            loads = []
            for position, kind in enumerate(pattern):
                # the layer's index in its group: earlier periods' layers of its kind, then this one's
                in_group = index * pattern.count(kind) + pattern[:position].count(kind)
                layer = layers[kind]
                (h, cache), load = layer.apply(
                    {"params": params[groups[kind].name]}, (h, _group_cache(caches, kind)), in_group, rope, meta
                )
                caches = _with_group_cache(caches, kind, cache)
                loads.append(load)
            return (h, caches), jnp.stack(loads)

        carry, loads = lax.scan(one_period, carry, jnp.arange(cfg.num_layers // period, dtype=jnp.int32))
        return carry, loads.reshape(cfg.num_layers, -1)
