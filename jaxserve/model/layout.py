"""How the model's weights and activations are laid out for the platform: the activations' dtype
(`compute_dtype`), 2-byte layer kernels packed as uint32 pairs (`pack_kernels`), kernels in the
cpu matmul's panels (`panel_kernels`), and per-layer weights for `unroll_layers` (`unstack_layers`).
The runner converts the parameters once, before the first step; `Linear` reads each layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.cpu_matmul import CpuMatmul, to_panels


def compute_dtype(dtype: Any, platform: str) -> jnp.dtype:
    """The dtype of activations and of the KV cache for weights in `dtype` on `platform`: the
    weights' own, but f32 on CPU. XLA:CPU (jaxlib 0.10.2) runs a bf16 scatter or
    dynamic-update-slice by converting the whole operand to f32 and back, so a bf16 KV cache
    costs a conversion of the whole cache at every layer's write (30-100x slower steps). Its bf16
    matmuls with f32 accumulation are fast (AVX512-BF16: ~2x f32 at a prefill's shapes), so on
    CPU bf16 means bf16 weights and matmul inputs, everything else f32."""
    return jnp.dtype(jnp.float32) if platform == "cpu" else jnp.dtype(dtype)


def packs_kernels(dtype: Any, platform: str) -> bool:
    """Whether the stacked layer kernels are stored packed (`pack_kernels`): 2-byte weights on
    CPU, where XLA:CPU slices a scanned layer's bf16 weights element by element (~0.5 G
    elements/s: ~250 ms a step for the default model) but 4-byte ones at memory speed."""
    return platform == "cpu" and jnp.dtype(dtype).itemsize == 2


def pack_kernels(params: Any) -> Any:
    """The parameters with each stacked layer kernel [L, in, out] of a 2-byte dtype stored as
    uint32 pairs [L, in, out / 2] (a bitcast, no conversion); `Linear(packed=True)` reads them.
    Kernels already in a cpu matmul's panels (`panel_kernels`, more dimensions) and expert kernels
    [L, X, in, out] (the experts' grouped matmuls read them) stay as they are."""

    def pack(path, x):
        name = jax.tree_util.keystr(path)
        if "layers" not in name or not name.endswith("['kernel']") or x.dtype.itemsize != 2 or x.ndim != 3:
            return x
        if x.shape[-1] % 2:
            raise ValueError(f"cannot pack {name} of shape {x.shape}: its output features are odd")
        return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)

    return jax.tree_util.tree_map_with_path(pack, params)


def panel_kernels(params: Any, cpu_matmul: CpuMatmul) -> Any:
    """The parameters with each stacked layer kernel [L, in, out] that `cpu_matmul` takes
    stored as its panels [L, out / P, in, P] (a quantized kernel's codes and scales each so),
    and a quantized output head's arrays [rows, V] as a stack of one [1, V / P, rows, P];
    `Linear(cpu_matmul=...)` and `QuantizedEmbed` read them."""

    def convert(path, x):
        name = jax.tree_util.keystr(path)
        quantized = (
            name.endswith(("['kernel_scale']", "['kernel_min']"))  # beside quantized codes
            or (name.endswith("['kernel']") and jnp.issubdtype(x.dtype, jnp.integer))
        )
        if x.ndim not in (2, 3) or not cpu_matmul.takes(x.shape[-1]):
            return x
        if "layers" in name and x.ndim == 3 and (quantized or name.endswith("['kernel']")):
            return to_panels(x, cpu_matmul.panel)
        if "layers" not in name and x.ndim == 2 and quantized:
            return to_panels(x[None], cpu_matmul.panel)
        return x

    return jax.tree_util.tree_map_with_path(convert, params)


def unstack_layers(tree: dict[str, Any], num_layers: int, take: Callable[[Any, int], Any]) -> dict[str, Any]:
    """A parameter tree (or a tree of its shardings) with its stacked `layers` replaced by
    `layers_0` ... `layers_{L-1}`, the layout `DecoderModel(unroll_layers=True)` takes; `take(leaf,
    i)` is layer i's part of a stacked leaf."""
    out = {name: sub for name, sub in tree.items() if name != "layers"}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda leaf: take(leaf, i), tree["layers"])
    return out
