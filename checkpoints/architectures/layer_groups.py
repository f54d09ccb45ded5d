"""A model's layer groups: its layers by kind, each kind's weights stacked apart under a
parameter group of its own and run over a cache of its own (docs/models.md: layer groups).

A model of one kind has one group, `layers`. A Gated DeltaNet hybrid (Qwen3.5, Qwen3-Next) has
two: `linear_layers` (Gated DeltaNet, a fixed-size state per sequence) and `layers` (full
attention over the paged KV cache). A group's stack index is not the model's layer number: its
`layers` says which layer each entry is (`Weight.layer_ids` names checkpoint tensors by it).
"""

from __future__ import annotations

import dataclasses

from checkpoints.config import ModelConfig

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    name: str  # its parameters' group (`<name>/q_proj/kernel` [len(layers), ...])
    kind: str  # LINEAR_ATTENTION or FULL_ATTENTION (any attention over the paged cache)
    layers: tuple[int, ...]  # the model's layer number of each stack entry, in order


def layer_groups(config: ModelConfig) -> tuple[LayerGroup, ...]:
    """The groups of `config`'s layers: one, `layers`, unless some are Gated DeltaNet layers."""
    kinds = config.layer_types or ()
    linear = tuple(i for i, kind in enumerate(kinds) if kind == LINEAR_ATTENTION)
    full = tuple(i for i in range(config.num_layers) if i not in linear)
    if not linear:
        return (LayerGroup("layers", FULL_ATTENTION, full),)
    return (LayerGroup("linear_layers", LINEAR_ATTENTION, linear), LayerGroup("layers", FULL_ATTENTION, full))


def is_hybrid(config: ModelConfig) -> bool:
    """Whether the model has Gated DeltaNet layers (a state cache besides the paged one)."""
    return len(layer_groups(config)) > 1


def group_config(config: ModelConfig, group: LayerGroup) -> ModelConfig:
    """`config` with the group's layers as its layers (the shapes of the group's stacks)."""
    types = tuple((config.layer_types or ())[i] for i in group.layers) if config.layer_types else None
    return dataclasses.replace(config, num_layers=len(group.layers), layer_types=types)


def paged_config(config: ModelConfig) -> ModelConfig:
    """`config` as its paged KV cache sees it: its full-attention layers only (a hybrid's `layers` group)."""
    full = next(g for g in layer_groups(config) if g.kind == FULL_ATTENTION)
    return group_config(config, full) if is_hybrid(config) else config


def layer_period(config: ModelConfig) -> int:
    """The shortest period of the layers' kinds (the hybrid's layers run as a scan over periods)."""
    kinds = config.layer_types or ("",) * config.num_layers
    n = len(kinds)
    return next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))
