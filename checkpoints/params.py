"""The parameter tree every loader produces, and helpers to build and check it.

Layout (nested dicts of numpy arrays; kernels are `[in, out]`; per-layer leaves are stacked
on axis 0 so the model can `lax.scan` over layers):

    embed/embedding [V, E]
    layers/attn_norm/scale [L, E]
    layers/{q,k,v}_proj/kernel [L, E, heads*D]   (+ /bias [L, heads*D] with attention_bias)
    layers/o_proj/kernel [L, H*D, E]
    layers/mlp_norm/scale [L, E]
    layers/{gate,up}_proj/kernel [L, E, F], layers/down_proj/kernel [L, F, E]
    final_norm/scale [E]
    lm_head/kernel [E, V]                        (absent when tie_word_embeddings)

Q and K projections are in the Hugging Face ("rotate half") RoPE layout.
"""

from __future__ import annotations

from typing import Any, Iterator

import ml_dtypes
import numpy as np

from checkpoints.config import ModelConfig
from checkpoints.errors import CheckpointError

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
    v, e, f, n = config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    layers: ParamTree = {
        "attn_norm": {"scale": (n, e)},
        "q_proj": {"kernel": (n, e, q_dim)},
        "k_proj": {"kernel": (n, e, kv_dim)},
        "v_proj": {"kernel": (n, e, kv_dim)},
        "o_proj": {"kernel": (n, q_dim, e)},
        "mlp_norm": {"scale": (n, e)},
        "gate_proj": {"kernel": (n, e, f)},
        "up_proj": {"kernel": (n, e, f)},
        "down_proj": {"kernel": (n, f, e)},
    }
    if config.attention_bias:
        layers["q_proj"]["bias"] = (n, q_dim)
        layers["k_proj"]["bias"] = (n, kv_dim)
        layers["v_proj"]["bias"] = (n, kv_dim)
    tree: ParamTree = {
        "embed": {"embedding": (v, e)},
        "layers": layers,
        "final_norm": {"scale": (e,)},
    }
    if not config.tie_word_embeddings:
        tree["lm_head"] = {"kernel": (e, v)}
    return tree


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
        f"{p} has shape {actual[p]}, expected {s}"
        for p, s in expected.items()
        if p in actual and actual[p] != tuple(s)
    ]
    if problems:
        raise CheckpointError(f"{source}: parameters do not match the config: " + "; ".join(problems))


class ParamFiller:
    """A preallocated parameter tree that loaders fill one tensor (or one layer's slice) at a time.

    Writing into the final stacked arrays keeps peak memory at one copy of the weights plus one
    tensor; `finish` names every slot no tensor filled.
    """

    def __init__(self, config: ModelConfig, dtype: np.dtype, source: str) -> None:
        self.source = source
        self.params = map_leaves(lambda shape: np.empty(shape, dtype), param_shapes(config))
        layers = self.params["layers"]
        slots = {(m, leaf, None) for m, leaves in self.params.items() if m != "layers" for leaf in leaves}
        slots |= {(m, leaf, i) for m in layers for leaf in layers[m] for i in range(config.num_layers)}
        self._slots = frozenset(slots)
        self._empty = set(slots)

    def accepts(self, module: str, leaf: str, layer: int | None) -> bool:
        """Whether the config has this slot (e.g. no lm_head when the embeddings are tied)."""
        return (module, leaf, layer) in self._slots

    def put(self, module: str, leaf: str, layer: int | None, value: np.ndarray, name: str) -> None:
        target = self.params[module][leaf] if layer is None else self.params["layers"][module][leaf][layer]
        if value.shape != target.shape:
            raise CheckpointError(
                f"{self.source}: {name} has shape {value.shape} after conversion, expected {target.shape}"
            )
        target[...] = value
        self._empty.discard((module, leaf, layer))

    def finish(self) -> ParamTree:
        if self._empty:
            missing = [
                (f"{m}/{leaf}" if layer is None else f"layers/{m}/{leaf}[layer {layer}]")
                for m, leaf, layer in sorted(self._empty, key=str)
            ]
            more = " ..." if len(missing) > 10 else ""
            raise CheckpointError(f"{self.source}: missing tensors: {', '.join(missing[:10])}{more}")
        return self.params
