"""Weight-only quantization of a parameter tree (`--quantization`), and its modes.

Modes (the command line's `--quantization`, named like vLLM's flag):

- `int8`: every quantizable kernel (`Weight.quantizable`: the layers' dense projections) as int8
  codes with one f32 scale per output channel (symmetric: scale = max |w| / 127);
- `q4`: as 4-bit codes in groups of 32 input features, each with an f16 scale and minimum
  (asymmetric: the group's [min, max] in 16 steps);
- `gguf`: a GGUF file's quantized blocks as stored (`checkpoints.gguf_blocks`): Q8_0 as int8 in
  groups of 32, Q4_0 / Q4_1 / Q4_K as 4 bits in groups of 32.

Embeddings, norms, biases, routers and experts stay in the model's dtype. The arrays a quantized
kernel becomes are declared (`checkpoints.weights.quantized`), so shardings and abstract shapes
derive from the declaration as for any weight. `int8` and `q4` quantize on the devices the
parameters are on (jitted), so restored shards are never gathered to the host.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.architectures import declare
from checkpoints.config import ModelConfig
from checkpoints.quant_format import CODES, MIN, Q4_GROUP, SCALE, QuantFormat, format_of
from checkpoints.params import iter_leaves
from checkpoints.weights import flat, nest

INT8, Q4 = "int8", "q4"  # the modes quantized here (`gguf`: checkpoints.gguf, the others: jaxserve.config)
Formats = dict[str, QuantFormat]  # {declared kernel path: its storage}


def formats_for(config: ModelConfig, mode: str) -> Formats:
    """The storage of each quantizable kernel of a `config` model under `int8` or `q4`."""
    out = {}
    for path, w in flat(declare(config)).items():
        if w.quantizable:
            out[path] = QuantFormat(8, w.shape[-2]) if mode == INT8 else QuantFormat(4, Q4_GROUP)
    return out


def formats_of(params: Any) -> Formats:
    """The storage of each quantized kernel of a parameter tree, read from its arrays."""
    out = {}

    def visit(node: dict, prefix: str) -> None:
        fmt = format_of(node)
        if fmt is not None:
            out[f"{prefix}/{CODES}"] = fmt
        for key, sub in node.items():
            if isinstance(sub, dict):
                visit(sub, f"{prefix}/{key}" if prefix else key)

    visit(params, "")
    return out


@functools.partial(jax.jit, static_argnums=(1,))
def quantize_kernel(w: jax.Array, fmt: QuantFormat) -> dict[str, jax.Array]:
    """A kernel [.., K, N] as the arrays of `fmt` (`QuantFormat.arrays`)."""
    *lead, k, n = w.shape
    groups = w.astype(jnp.float32).reshape(*lead, k // fmt.group, fmt.group, n)
    if fmt.bits == 8:
        amax = jnp.max(jnp.abs(groups), axis=-2)
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        codes = jnp.clip(jnp.round(groups / scale[..., None, :]), -127, 127).astype(jnp.int8)
        return {CODES: codes.reshape(*lead, k, n), SCALE: scale}
    low, high = jnp.min(groups, axis=-2), jnp.max(groups, axis=-2)
    minimum = low.astype(jnp.float16)
    scale = jnp.where(high > low, (high - minimum.astype(jnp.float32)) / 15.0, 1.0).astype(jnp.float16)
    codes = jnp.round((groups - minimum[..., None, :].astype(jnp.float32)) / scale[..., None, :].astype(jnp.float32))
    codes = jnp.clip(codes, 0, 15).astype(jnp.uint8).reshape(*lead, k // 2, 2, n)
    return {CODES: codes[..., 0, :] | (codes[..., 1, :] << 4), SCALE: scale, MIN: minimum}


def quantize_params(params: Any, config: ModelConfig, mode: str) -> Any:
    """The tree with every quantizable kernel stored as `mode` says (`int8` or `q4`)."""
    leaves = dict(iter_leaves(params))
    for path, fmt in formats_for(config, mode).items():
        parent = path.rsplit("/", 1)[0]
        for name, array in quantize_kernel(leaves.pop(path), fmt).items():
            leaves[f"{parent}/{name}"] = array
    return nest(leaves)
