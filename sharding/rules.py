"""Partition rules as data: each declared weight's logical axes -> mesh axes.

Every architecture declares its weights' logical axes (`checkpoints.weights`); `LOGICAL_AXES`
says which mesh axis splits each. The split is Megatron's for tensor parallelism (`tp`): q/k/v
and gate/up are column-parallel (their output features, i.e. whole heads and MLP hidden units,
split over `tp`), o and down are row-parallel (their input features split, so each device holds a
partial sum and one all-reduce per block completes it). Attention then needs no communication:
each device owns whole heads. The embedding and the LM head are split over the vocabulary; norms
are replicated. Mixture-of-experts weights are split over `ep` by expert (expert parallelism) and
over `tp` by each expert's hidden units. The KV cache `[L, KVH, NB, BS, D]` is split over kv
heads, matching the k/v projections (and replicated over `ep`). A Gated DeltaNet layer splits by its
heads the same way (`sharding.linear_heads`), and its states by state slot with them. With pipeline stages (`pp` > 1)
the stacked layer axis of the layer weights and of the cache is split over `pp`
(`sharding.pipeline`); the embedding, head and final norm are replicated over it.

Parameter paths are the slash-joined keys of the parameter tree (`checkpoints.params`), e.g.
`layers/q_proj/kernel`. Every leaf must be declared; a dimension the mesh does not divide is
replicated instead (with a warning), which stays correct and costs memory.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoints.architectures import declare
from checkpoints.config import ModelConfig
from checkpoints.quant_format import QuantFormat
from checkpoints.weights import (
    EXPERT_FFW,
    EXPERTS,
    FFW,
    KV_HEADS,
    LAYERS,
    LINEAR_HEADS,
    Q_HEADS,
    VOCAB,
    Weight,
    flat,
    quantized,
)
from sharding.pipeline import PP

logger = logging.getLogger(__name__)

TP = "tp"
EP = "ep"

# Logical axis -> mesh axis; every other logical axis (layers, embed, head_dim, router) is replicated.
LOGICAL_AXES: dict[str, str] = {
    VOCAB: TP,  # embedding [V, E] and head [E, V]: vocab-parallel logits, gathered once
    Q_HEADS: TP,  # q projection's outputs (column-parallel), o projection's inputs (row-parallel)
    KV_HEADS: TP,
    FFW: TP,  # gate/up outputs (column-parallel), down inputs (row-parallel)
    EXPERTS: EP,  # whole experts per device
    EXPERT_FFW: TP,  # and each expert's hidden units split like a dense MLP's
    LINEAR_HEADS: TP,  # a Gated DeltaNet's heads (sharding.linear_heads)
    LAYERS: PP,  # stacked layers: contiguous stages (only on a mesh with pp > 1)
}
KV_CACHE_SPEC = P(None, TP)  # [L, KVH, NB, BS, D]: split over kv heads (and over pp: `cache_sharding`)
LOGITS_SPEC = P(None, TP)  # [rows, V]: as the vocab-parallel head computes them


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh, weight: Weight) -> P:
    """The PartitionSpec of the parameter at `path` with `shape` on `mesh`, declared as `weight`
    (its logical axes line up with the leading axes of `shape`)."""
    axes = [LOGICAL_AXES.get(axis) if axis is not None else None for axis in weight.axes]
    if dict(mesh.shape).get(PP, 1) == 1:
        axes = [None if axis == PP else axis for axis in axes]  # layers are split only into several stages
    if not any(axes):
        return P()  # replicated (norm scales, routers)
    return _divisible(path, shape, P(*axes), mesh)


def _divisible(path: str, shape: tuple[int, ...], spec: P, mesh: Mesh) -> P:
    if len(spec) > len(shape):
        raise ValueError(f"partition spec {spec} has more axes than parameter {path!r} of shape {shape}")
    axes = []
    for dim, axis in zip(shape, spec):
        if axis is not None and axis not in mesh.shape:
            axis = None  # a mesh without that axis (e.g. no "ep") keeps the dimension whole
        ways = 1 if axis is None else mesh.shape[axis]
        if dim % ways:
            logger.warning("%s: dimension %d does not split %d ways over %r; replicating it", path, dim, ways, axis)
            axis = None
        axes.append(axis)
    return P(*axes)


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(leaf) if isinstance(leaf, tuple) else tuple(leaf.shape)


def _path(keys: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in keys)


def param_shardings(
    tree: Any, mesh: Mesh, config: ModelConfig, quantization: dict[str, QuantFormat] | None = None
) -> Any:
    """A NamedSharding for every leaf of a parameter tree of a `config` model, same nesting;
    `quantization`: its quantized kernels ({path: storage}), whose arrays shard like the kernel.

    Leaves may be arrays (numpy or jax), `jax.ShapeDtypeStruct`s or shape tuples (as from
    `checkpoints.params.param_shapes`), so the result serves both to place loaded parameters
    and as `load_model(..., shardings=...)` targets that restore straight into shards.
    """
    weights = flat(quantized(declare(config), quantization or {}))

    def sharding(keys: tuple, leaf: Any) -> NamedSharding:
        path = _path(keys)
        if path not in weights:
            raise ValueError(f"parameter {path!r} is not declared by the {config.architecture} architecture")
        return NamedSharding(mesh, spec_for(path, _shape(leaf), mesh, weights[path]))

    return jax.tree_util.tree_map_with_path(
        sharding, tree, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)
    )


def layer_sharding(stacked: NamedSharding, layer: int) -> NamedSharding:
    """The sharding of layer `layer`'s slice of a stacked [L, ...] parameter (`unstack_layers`):
    its spec without the layer axis, which is never split."""
    return NamedSharding(stacked.mesh, P(*stacked.spec[1:]))


def cache_sharding(mesh: Mesh, latent: bool = False) -> NamedSharding:
    """Sharding of each of the KV cache's K and V arrays [L, KVH, NB, BS, D]; a `latent` cache
    (multi-head latent attention: one latent per token, no heads) is replicated."""
    if latent:
        return NamedSharding(mesh, P())
    if dict(mesh.shape).get(PP, 1) > 1:
        return NamedSharding(mesh, P(PP, *KV_CACHE_SPEC[1:]))
    return NamedSharding(mesh, KV_CACHE_SPEC)


def logits_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Sharding of the head's logits [rows, V]: split over the vocabulary like the head's
    weights (replicated where the mesh does not divide V, as those weights are)."""
    return NamedSharding(mesh, _divisible("logits", shape, LOGITS_SPEC, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
