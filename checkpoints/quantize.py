"""Weight-only quantization of a parameter tree (`--quantization`), and its modes.

Modes (the command line's `--quantization`, named like vLLM's flag):

- `int8`: every quantizable kernel (`Weight.quantizable`: the layers' dense projections and the
  output head) as int8 codes with one f32 scale per output channel (symmetric: scale = max |w| /
  127), but the output head's in groups of 32 input features (a scale per 32 hidden features of
  each token: GGUF Q8_0's blocks, lossless on a table stored so);
- `q4`: as 4-bit codes in groups of 32 input features, each with an f16 scale and minimum
  (asymmetric: the group's [min, max] in 16 steps); the output head as under `int8` (a 4-bit
  head costs too much accuracy: `HEAD_INT8_GROUP`);
- `gguf`: a GGUF file's quantized blocks as stored (`checkpoints.gguf_blocks`): Q8_0 as int8 in
  groups of 32, Q4_0 / Q4_1 / Q4_K as 4 bits in groups of 32; a head stored in another type is
  quantized here to int8 in groups of 32 (`quantize_head`).

An embedding table tied to the head is stored as the head's kernel [E, V] (`embed/kernel`, ...):
the head reads the codes through the layers' quantized matmul, and the lookup dequantizes only the
rows it gathers (`jaxserve.model.quantized`). An untied embedding, norms, biases, routers and
experts stay in the model's dtype. The arrays a quantized kernel becomes are declared
(`checkpoints.weights.quantized`), so shardings and abstract shapes derive from the declaration
as for any weight. `int8` and `q4` quantize on the devices the parameters are on (jitted), so
restored shards are never gathered to the host.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp

from checkpoints.architectures import declare
from checkpoints.config import ModelConfig
from checkpoints.params import iter_leaves
from checkpoints.quant_format import CODES, HEADS, MIN, Q4_GROUP, SCALE, QuantFormat, format_of
from checkpoints.weights import nest, quantizable

logger = logging.getLogger(__name__)

INT8, Q4, GGUF = "int8", "q4", "gguf"  # the modes (GGUF's blocks: checkpoints.gguf; the others: jaxserve.config)
Formats = dict[str, QuantFormat]  # {codes path (`checkpoints.weights.codes_path`): its storage}
# The output head under int8 and q4: int8 codes with a scale per 32 hidden features of each token
# (GGUF Q8_0's blocks). Measured on the default model over real text (tests/bench/test_quant_accuracy.py),
# against f32: a scale per token lost 1.3 points of top-1 agreement (0.9775 -> 0.9647), and a
# 4-bit head took q4 from lossless to top-1 0.86 and perplexity +5.6%.
HEAD_INT8_GROUP = 32


def formats_for(config: ModelConfig, mode: str) -> Formats:
    """The storage of each quantizable kernel of a `config` model under `int8` or `q4`."""
    out = {}
    for path, (_, w) in quantizable(declare(config)).items():
        k = w.kernel_shape[-2]
        if path in HEADS:  # under q4 too (see HEAD_INT8_GROUP); per channel where groups do not fit
            out[path] = QuantFormat(8, HEAD_INT8_GROUP if k % HEAD_INT8_GROUP == 0 else k)
        else:
            out[path] = QuantFormat(8, k) if mode == INT8 else QuantFormat(4, Q4_GROUP)
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


def quantize_params(params: Any, config: ModelConfig, mode: str, only: tuple[str, ...] | None = None) -> Any:
    """The tree with every quantizable kernel (those of `only`, codes paths, where given) stored
    as `mode` says (`int8` or `q4`). A tied embedding table [V, E] is quantized as its transpose."""
    leaves = dict(iter_leaves(params))
    kernels = quantizable(declare(config))
    for path, fmt in formats_for(config, mode).items():
        if only is not None and path not in only:
            continue
        declared, weight = kernels[path]
        w = leaves.pop(declared)
        if weight.kernel_shape != weight.shape:
            w = w.T
        parent = path.rsplit("/", 1)[0]
        for name, array in quantize_kernel(w, fmt).items():
            leaves[f"{parent}/{name}"] = array
    return nest(leaves)


def quantize_head(params: Any, config: ModelConfig) -> Any:
    """`gguf`: the tree with its output head quantized to int8 (groups of 32) where the file's head
    was not kept as stored (a type `checkpoints.gguf_blocks` does not repack, e.g. Q6_K or F16),
    so that the head is quantized whatever the file stores."""
    head = next(path for path in HEADS if path in quantizable(declare(config)))
    stored = formats_of(params).get(head)
    if stored is not None:
        logger.info("quantization gguf: output head %s served as the file stores it (%s)", head, stored.name)
        return params
    logger.info(
        "quantization gguf: output head %s quantized from the loaded values to int8 in groups of 32 "
        "(the file's type is not one served as stored)",
        head,
    )
    return quantize_params(params, config, INT8, only=(head,))
