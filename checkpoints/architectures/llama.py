"""Llama 2 / 3 and SmolLM2: the base layer (RMS norms, RoPE attention, SwiGLU MLP).

llama.cpp's converter permutes the rows of Llama's Q and K projections (per head, the two halves
of the head dimension interleaved) to suit its interleaved-pair RoPE; loading undoes that, so
every checkpoint format meets the model in Hugging Face's "rotate half" layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from checkpoints.architectures import blocks
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.hf_config import common_fields, common_hf
from checkpoints.config import ModelConfig
from checkpoints.weights import Declaration


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (works on `[out, in]` weights and `[out]` biases).

    llama.cpp's converter reshapes the rows of each head as (2, D/2) and swaps the axes, so
    rows (i, D/2 + i) of a head end up next to each other; this restores the original order.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def from_llama_gguf(path: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A GGUF tensor (`[out, in]`) of a `llama` file with its Q/K rows un-permuted."""
    heads = {
        "layers/q_proj/kernel": config.num_heads,
        "layers/q_proj/bias": config.num_heads,
        "layers/k_proj/kernel": config.num_kv_heads,
        "layers/k_proj/bias": config.num_kv_heads,
    }
    return unpermute_rope_rows(array, heads[path]) if path in heads else array


def weights(config: ModelConfig) -> Declaration:
    return blocks.decoder(config, blocks.llama_norms(config), blocks.dense_mlp(config))


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return common_fields(hf, "llama")


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return common_hf(config, "LlamaForCausalLM")


ARCHITECTURE = Architecture(
    "llama",
    "LlamaForCausalLM",
    weights,
    from_hf,
    to_hf,
    from_gguf=lambda *_: {},
    gguf_name="llama",
    from_gguf_tensor=from_llama_gguf,
)
