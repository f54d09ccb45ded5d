"""Partition rules as data: parameter path pattern -> PartitionSpec over the mesh's "tp" axis.

The split is Megatron's: q/k/v and gate/up are column-parallel (their output features, i.e.
whole heads and MLP hidden units, split over `tp`), o and down are row-parallel (their input
features split, so each device holds a partial sum and one all-reduce per block completes it).
Attention then needs no communication at all: each device owns whole heads. The embedding
and the LM head are split over the vocabulary; norms are replicated. The KV cache
`[L, KVH, NB, BS, D]` is split over kv heads, matching the k/v projections.

Parameter paths are the slash-joined keys of the parameter tree (`checkpoints.params`), e.g.
`layers/q_proj/kernel`. Every leaf must match a rule; a dimension the mesh does not divide is
replicated instead (with a warning), which stays correct and costs memory.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

logger = logging.getLogger(__name__)

TP = "tp"

# First match wins. Shapes: kernels [L, in, out] per layer (stacked), [in, out] otherwise.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"^embed/embedding$", P(TP, None)),  # [V, E]: vocab-parallel
    (r"^lm_head/kernel$", P(None, TP)),  # [E, V]: vocab-parallel logits, gathered once
    (r"^layers/(q|k|v|gate|up)_proj/kernel$", P(None, None, TP)),  # column-parallel
    (r"^layers/(q|k|v)_proj/bias$", P(None, TP)),
    (r"^layers/(o|down)_proj/kernel$", P(None, TP, None)),  # row-parallel
    (r"(^|/)[a-z_]*norm/scale$", P()),  # replicated
)
KV_CACHE_SPEC = P(None, TP)  # [L, KVH, NB, BS, D]: split over kv heads
LOGITS_SPEC = P(None, TP)  # [rows, V]: as the vocab-parallel head computes them


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of the parameter at `path` with `shape` on `mesh`."""
    for pattern, spec in PARAM_RULES:
        if re.search(pattern, path):
            return _divisible(path, shape, spec, mesh)
    raise ValueError(f"no partition rule matches parameter {path!r} (see sharding.rules.PARAM_RULES)")


def _divisible(path: str, shape: tuple[int, ...], spec: P, mesh: Mesh) -> P:
    if len(spec) > len(shape):
        raise ValueError(f"partition spec {spec} has more axes than parameter {path!r} of shape {shape}")
    axes = []
    for dim, axis in zip(shape, spec):
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


def param_shardings(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every leaf of a parameter tree, same nesting.

    Leaves may be arrays (numpy or jax), `jax.ShapeDtypeStruct`s or shape tuples (as from
    `checkpoints.params.param_shapes`), so the result serves both to place loaded parameters
    and as `load_model(..., shardings=...)` targets that restore straight into shards.
    """
    return jax.tree_util.tree_map_with_path(
        lambda keys, leaf: NamedSharding(mesh, spec_for(_path(keys), _shape(leaf), mesh)),
        tree,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x),
    )


def layer_sharding(stacked: NamedSharding, layer: int) -> NamedSharding:
    """The sharding of layer `layer`'s slice of a stacked [L, ...] parameter (`unstack_layers`):
    its spec without the layer axis, which is never split."""
    return NamedSharding(stacked.mesh, P(*stacked.spec[1:]))


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of each of the KV cache's K and V arrays."""
    return NamedSharding(mesh, KV_CACHE_SPEC)


def logits_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Sharding of the head's logits [rows, V]: split over the vocabulary like the head's
    weights (replicated where the mesh does not divide V, as those weights are)."""
    return NamedSharding(mesh, _divisible("logits", shape, LOGITS_SPEC, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
