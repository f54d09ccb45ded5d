"""`HostPack`: a pytree of host arrays that a compiled call takes as one int32 buffer."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax import lax


@jax.tree_util.register_pytree_node_class
class HostPack:
    """A pytree of host arrays that a compiled call takes as one int32 buffer.

    Each numpy argument of a compiled call is a host-to-device transfer of its own (~1.5 us each
    on the CPU backend of a 2-core host), so the runner ships a program's arrays packed: `of`
    concatenates a pytree of numpy arrays into one buffer (float32 and uint32 bit-cast, bool
    widened), and `unpack`, inside the jitted function, slices them back out at static offsets.
    The layout (tree structure, shapes, dtypes) is the pytree's static aux data, so arrays of
    the same shapes and dtypes give the same compiled signature.
    """

    __slots__ = ("buffer", "layout")

    def __init__(self, buffer: Any, layout: tuple):
        self.buffer = buffer
        self.layout = layout

    @classmethod
    def of(cls, tree: Any) -> HostPack:
        """Pack a pytree of numpy arrays of dtypes int32, uint32, float32 and bool."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        words = [a if a.dtype == _INT32 else _as_words(a) for a in leaves]
        buffer = np.concatenate(words, axis=None) if words else np.zeros(0, np.int32)
        return cls(buffer, (treedef, tuple([(a.shape, a.dtype) for a in leaves])))

    def unpack(self) -> Any:
        """The packed pytree, its arrays sliced out of the buffer (in the jitted function)."""
        treedef, specs = self.layout
        leaves, offset = [], 0
        for shape, dtype in specs:
            size = math.prod(shape)
            words = self.buffer[offset : offset + size].reshape(shape)
            leaves.append(words != 0 if dtype == np.bool_ else lax.bitcast_convert_type(words, dtype))
            offset += size
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def tree_flatten(self) -> tuple[tuple[Any], tuple]:
        return (self.buffer,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: tuple, children: tuple[Any]) -> HostPack:
        return cls(children[0], layout)


_INT32 = np.dtype(np.int32)


def _as_words(a: np.ndarray) -> np.ndarray:
    """A HostPack leaf that is not int32 as int32 words: bit-cast, or a bool widened."""
    if a.dtype in (np.uint32, np.float32):
        return a.view(np.int32)
    if a.dtype == np.bool_:
        return a.astype(np.int32)
    raise TypeError(f"HostPack takes int32, uint32, float32 and bool arrays, not {a.dtype}")
