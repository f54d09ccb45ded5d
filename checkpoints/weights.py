"""Declared weights: every parameter of an architecture, stated once.

An architecture (`checkpoints/architectures/`) declares each weight of a model as a `Weight`:
its shape, its logical axes, how random weights are drawn, and its names in Hugging Face and
GGUF checkpoints. Everything else derives from that declaration:

- the parameter tree's shapes (`shapes`) and abstract arrays (`abstract`), which the loaders fill,
  orbax restores and the model's modules check;
- the shardings (`sharding.rules`, from the logical axes);
- random weights, on the host (`random_tree`, the tiny test models) or on a device
  (`device_initializer`, the GPU check);
- checkpoint loading (`checkpoints.hf`, `checkpoints.gguf`: the names and their places).

A declaration is a nested dict of `Weight`s with the nesting of the parameter tree: per-layer
weights are stacked under `layers` (leading axis `"layers"`), mixture-of-experts weights carry an
`"experts"` axis after it. Kernels are `[in, out]` (checkpoints store `[out, in]`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from checkpoints.quant_format import CODES, QuantFormat

# Logical axes of declared weights; `sharding.rules.LOGICAL_AXES` maps them onto mesh axes.
LAYERS = "layers"  # the stack of layers (never split)
VOCAB = "vocab"
EMBED = "embed"  # the model's hidden features
Q_HEADS = "q_heads"  # query heads x head_dim (attention output features too)
KV_HEADS = "kv_heads"  # kv heads x head_dim
HEAD_DIM = "head_dim"
FFW = "ffw"  # hidden units of a dense MLP
EXPERTS = "experts"  # the experts of a mixture-of-experts layer
EXPERT_FFW = "expert_ffw"  # hidden units of one expert
ROUTER = "router"  # the router's output, one logit per expert (small: never split)
LINEAR_HEADS = "linear_heads"  # a Gated DeltaNet's heads: its conv channels, value features, per-head parameters

# How random weights are drawn (scaled like a trained network's, so activations keep unit
# variance and greedy decoding is not dominated by ties).
KERNEL = "kernel"  # N(0, 1 / fan_in), fan_in = shape[-2]
EMBEDDING = "embedding"  # N(0, 1)
SCALE = "scale"  # 1 + N(0, 0.1^2): norm scales
BIAS = "bias"  # N(0, 0.1^2)
ROUTER_KERNEL = "router_kernel"  # N(0, 4 / fan_in): router logits spread wide, so top-k is never a near tie
CONV = "conv"  # N(0, 1 / width): a depthwise convolution's taps [.., channels, width], stored as checkpoints do
INITIALIZERS = (KERNEL, EMBEDDING, SCALE, BIAS, ROUTER_KERNEL, CONV)

Declaration = dict[str, Any]  # nested dicts of Weight


@dataclasses.dataclass(frozen=True)
class Weight:
    """One declared parameter.

    `hf` / `gguf`: the tensor's name in a Hugging Face / GGUF checkpoint, with `{layer}` and
    `{expert}` where the checkpoint holds one tensor per layer / expert (None: the format has no
    such tensor). A checkpoint tensor fills the place in the leaf its name's placeholders pick;
    `{layer}` numbers a stack's layers by `layer_ids` where given (a hybrid's layer groups; DeepSeek-V3's
    mixture-of-experts layers, a stack of their own named from layer `first_k_dense_replace` on).

    `quantizable`: a kernel that `--quantization` may store as integer codes and scales
    (`quantized`): the layers' projections, the output head, and an embedding table tied to the
    head, which is stored as the head's kernel [E, V] (its transpose: `kernel_shape`). The arrays
    of a quantized kernel are declared too: `storage` is their dtype (whatever the model's), and
    the codes' `quant` says how the kernel is stored.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str
    float32: bool = False  # kept in f32 whatever the model's dtype (norm scales)
    hf: str | None = None
    gguf: str | None = None
    quantizable: bool = False
    storage: str | None = None
    quant: QuantFormat | None = None
    # The checkpoint's layer number of each entry of a stack (a layer group's: `{layer}` of its names);
    # None: the stack's own index.
    layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"weight of shape {self.shape} declares {len(self.axes)} axes {self.axes}")
        if self.init not in INITIALIZERS:
            raise ValueError(f"unknown initializer {self.init!r}; use one of {INITIALIZERS}")

    @property
    def is_kernel(self) -> bool:
        """A matrix `[.., in, out]` that checkpoints store transposed, `[.., out, in]`."""
        return self.init in (KERNEL, ROUTER_KERNEL)

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        """The shape [.., in, out] of the kernel this quantizable weight is: its own, but an
        embedding table [V, E] (tied to the output head) is the head's kernel [E, V]."""
        return self.shape[::-1] if self.init == EMBEDDING else self.shape

    @property
    def kernel_axes(self) -> tuple[str | None, ...]:
        """The logical axes of `kernel_shape`."""
        return self.axes[::-1] if self.init == EMBEDDING else self.axes

    def dtype(self, param_dtype: Any) -> np.dtype:
        if self.storage is not None:
            return np.dtype(self.storage)
        return np.dtype(np.float32) if self.float32 else np.dtype(param_dtype)

    def scaled(self, noise: Any) -> Any:
        """Values of this weight from standard-normal `noise` of its shape (numpy or jax)."""
        if self.init == KERNEL:
            return noise / np.sqrt(self.shape[-2])
        if self.init == ROUTER_KERNEL:
            return noise * (2.0 / np.sqrt(self.shape[-2]))
        if self.init == SCALE:
            return 1.0 + 0.1 * noise
        if self.init == BIAS:
            return 0.1 * noise
        if self.init == CONV:
            return noise / np.sqrt(self.shape[-1])
        return noise

    def unstacked(self) -> Weight:
        """One layer's weight: the declaration without its leading `layers` axis."""
        if not self.axes or self.axes[0] != LAYERS:
            return self
        return dataclasses.replace(self, shape=self.shape[1:], axes=self.axes[1:], layer_ids=None)

    def flax_init(self) -> Callable[[Any, tuple[int, ...], Any], Any]:
        """A Flax initializer drawing this weight as `scaled` says."""

        def init(key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
            return self.scaled(jax.random.normal(key, shape, np.float32)).astype(dtype)

        return init


def iter_weights(declaration: Declaration, prefix: str = "") -> Iterator[tuple[str, Weight]]:
    """(slash-joined path, Weight) for every leaf, in sorted key order."""
    for key in sorted(declaration):
        path = f"{prefix}/{key}" if prefix else key
        node = declaration[key]
        if isinstance(node, Weight):
            yield path, node
        else:
            yield from iter_weights(node, path)


def flat(declaration: Declaration) -> dict[str, Weight]:
    return dict(iter_weights(declaration))


def nest(leaves: dict[str, Any]) -> dict[str, Any]:
    """A nested dict from slash-joined paths."""
    tree: dict[str, Any] = {}
    for path, value in leaves.items():
        *parents, leaf = path.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def codes_path(path: str) -> str:
    """Where the codes of the quantizable weight at `path` go: `kernel` beside it (the path of a
    layer's or the head's kernel itself; `embed/kernel` for a tied embedding table)."""
    return f"{path.rsplit('/', 1)[0]}/{CODES}"


def quantizable(declaration: Declaration) -> dict[str, tuple[str, Weight]]:
    """{codes path (`codes_path`): (declared path, weight)} of every quantizable weight."""
    return {codes_path(path): (path, w) for path, w in iter_weights(declaration) if w.quantizable}


def quantized(declaration: Declaration, formats: dict[str, QuantFormat]) -> Declaration:
    """The declaration with each kernel of `formats` ({codes path: format}, quantizable weights
    only) replaced by the arrays that store it (`QuantFormat.arrays` of its `kernel_shape`: codes
    under `kernel`, scales beside them), on the kernel's logical axes. A per-output-channel
    scale's single group is not split."""
    leaves = flat(declaration)
    kernels = quantizable(declaration)
    for path, fmt in formats.items():
        if path not in kernels:
            raise ValueError(f"{path} is not a quantizable kernel of this model")
        declared, base = kernels[path]
        del leaves[declared]
        parent = path.rsplit("/", 1)[0]
        kernel_axes = base.kernel_axes
        for name, (shape, dtype) in fmt.arrays(base.kernel_shape).items():
            axes = kernel_axes if shape[-2] > 1 else (*kernel_axes[:-2], None, kernel_axes[-1])
            leaves[f"{parent}/{name}"] = dataclasses.replace(
                base,
                shape=shape,
                axes=axes,
                init=KERNEL,
                storage=dtype.name,
                quant=fmt if name == CODES else None,
                hf=None,
                gguf=None,
                quantizable=False,
            )
    return nest(leaves)


def shapes(declaration: Declaration) -> dict[str, Any]:
    """The shape of every leaf, with the declaration's nesting."""
    return nest({path: w.shape for path, w in iter_weights(declaration)})


def abstract(declaration: Declaration, dtype: Any) -> dict[str, Any]:
    """A `jax.ShapeDtypeStruct` for every leaf (norm scales f32, the rest in `dtype`)."""
    return nest({path: jax.ShapeDtypeStruct(w.shape, w.dtype(dtype)) for path, w in iter_weights(declaration)})


def random_tree(declaration: Declaration, seed: int, dtype: Any) -> dict[str, Any]:
    """Random numpy parameters as each weight's initializer says; same seed, same arrays."""
    rng = np.random.default_rng(seed)
    leaves = {}
    for path, w in iter_weights(declaration):
        noise = rng.standard_normal(w.shape, dtype=np.float32)
        leaves[path] = np.asarray(w.scaled(noise)).astype(w.dtype(dtype))
    return nest(leaves)


def device_initializer(declaration: Declaration, dtype: Any, seed: int = 0) -> Callable[[], dict[str, Any]]:
    """A function (to jit, with the parameters' shardings as its output shardings) that draws the
    parameters on the device with XLA's fast bit generator: nothing is made on the host."""
    weights = list(iter_weights(declaration))

    def init() -> dict[str, Any]:
        keys = jax.random.split(jax.random.key(seed, impl="unsafe_rbg"), len(weights))
        leaves = {}
        for key, (path, w) in zip(keys, weights):
            leaf_dtype = w.dtype(dtype)
            leaves[path] = w.scaled(jax.random.normal(key, w.shape, leaf_dtype)).astype(leaf_dtype)
        return nest(leaves)

    return init
