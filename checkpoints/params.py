"""The parameter tree every loader produces, and helpers to build and check it.

The tree is a nested dict of numpy arrays whose paths, shapes and logical axes the model's
architecture declares (`checkpoints.architectures`, `checkpoints.weights`; the paths are listed
in `checkpoints/architectures/blocks.py`). Kernels are `[in, out]`; per-layer leaves are stacked
on axis 0 so the model can `lax.scan` over layers. Q and K projections are in the Hugging Face
("rotate half") RoPE layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

from checkpoints.architectures import declare
from checkpoints.config import ModelConfig
from checkpoints.errors import CheckpointError
from checkpoints.weights import Weight, flat, nest, shapes

ParamTree = dict[str, Any]

_DTYPE_NAMES = {
    "float32": np.dtype(np.float32),
    "f32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "f16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
}


def resolve_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a name ('float32', 'bf16', ...) or anything `np.dtype` accepts."""
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPE_NAMES:
            raise ValueError(f"unsupported parameter dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[dtype.lower()]
    resolved = np.dtype(dtype)
    if resolved not in _DTYPE_NAMES.values():
        raise ValueError(f"unsupported parameter dtype {resolved}; use float32, float16 or bfloat16")
    return resolved


def param_shapes(config: ModelConfig) -> ParamTree:
    """The shape of every leaf of the parameter tree for `config` (same nesting as the tree)."""
    return shapes(declare(config))


def iter_leaves(tree: ParamTree, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(slash-joined path, leaf) for every leaf of a nested dict, in sorted key order."""
    for key in sorted(tree):
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(tree[key], dict):
            yield from iter_leaves(tree[key], path)
        else:
            yield path, tree[key]


def map_leaves(fn: Any, tree: ParamTree) -> ParamTree:
    """A new nested dict with `fn` applied to every leaf."""
    return {k: map_leaves(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def validate_params(params: ParamTree, config: ModelConfig, source: str) -> None:
    """Raise `CheckpointError` naming every missing, unexpected or misshapen leaf."""
    expected = dict(iter_leaves(param_shapes(config)))
    actual = {path: tuple(np.shape(leaf)) for path, leaf in iter_leaves(params)}
    problems = [f"missing {p} {s}" for p, s in expected.items() if p not in actual]
    problems += [f"unexpected {p} {s}" for p, s in actual.items() if p not in expected]
    problems += [
        f"{p} has shape {actual[p]}, expected {s}" for p, s in expected.items() if p in actual and actual[p] != tuple(s)
    ]
    if problems:
        raise CheckpointError(f"{source}: parameters do not match the config: " + "; ".join(problems))


_PLACEHOLDER = re.compile(r"\{(layer|expert)\}")


def checkpoint_names(weight: Weight, template: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every concrete tensor name of a weight's name template, with the index of its place in the
    leaf: `{layer}` ranges over the leaf's axis 0 (named by `Weight.layer_ids` where given), `{expert}`
    over axis 1."""
    kinds = _PLACEHOLDER.findall(template)
    ranges = [range(weight.shape[0 if kind == "layer" else 1]) for kind in kinds]
    if not kinds:
        yield template, ()
        return
    layer_ids = weight.layer_ids or range(weight.shape[0])
    for index in np.ndindex(*(len(r) for r in ranges)):
        names = {kind: layer_ids[i] if kind == "layer" else i for kind, i in zip(kinds, index)}
        yield template.format(**names), tuple(int(i) for i in index)


class ParamFiller:
    """A preallocated parameter tree that loaders fill one checkpoint tensor at a time.

    `names` picks a format's tensor names from each declared weight (`lambda w: w.hf`, say); a
    tensor fills the place its name picks (a whole leaf, one layer's part or one expert's). Writing
    into the final stacked arrays keeps peak memory at one copy of the weights plus one tensor;
    `finish` names every place no tensor filled. `declaration`: the weights to fill ({path: Weight};
    by default every weight of `config`).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: np.dtype,
        source: str,
        names: Any,
        declaration: dict[str, Weight] | None = None,
    ) -> None:
        self.source = source
        weights = flat(declare(config)) if declaration is None else declaration
        self.weights = weights
        self.params = nest({path: np.empty(w.shape, w.dtype(dtype)) for path, w in weights.items()})
        self._leaves = dict(iter_leaves(self.params))
        self._places: dict[str, tuple[str, tuple[int, ...]]] = {}
        for path, w in weights.items():
            template = names(w)
            if template is None:
                raise CheckpointError(f"{source}: this format has no tensor for {path} of {config.architecture}")
            for name, index in checkpoint_names(w, template):
                self._places[name] = (path, index)
        self._empty = set(self._places)

    def place(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """(parameter path, index in the leaf) the tensor `name` fills, or None if none."""
        return self._places.get(name)

    def put(self, name: str, value: np.ndarray) -> None:
        path, index = self._places[name]
        target = self._leaves[path][index]
        if value.shape != target.shape:
            raise CheckpointError(
                f"{self.source}: {name} has shape {value.shape} after conversion, expected {target.shape}"
            )
        target[...] = value
        self._empty.discard(name)

    def finish(self) -> ParamTree:
        if self._empty:
            missing = sorted(self._empty)
            more = " ..." if len(missing) > 10 else ""
            raise CheckpointError(f"{self.source}: missing tensors: {', '.join(missing[:10])}{more}")
        return self.params
