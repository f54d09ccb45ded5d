"""Gemma 3 (text): local sliding-window layers interleaved with global ones (five to one), each
kind with its own RoPE base; GeGLU MLP; four norms per layer (before and after attention and
the MLP) and q/k norms; embeddings scaled by sqrt(hidden_size); attention scaled by
`query_pre_attn_scalar`; tied embeddings.

Gemma's RMS norms multiply by (1 + weight): Hugging Face checkpoints store the weight, GGUF files
(llama.cpp's converter) store 1 + weight. We keep 1 + weight, so every norm is the same block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from checkpoints.architectures import blocks
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.hf_config import common_fields, common_hf, rope
from checkpoints.config import ModelConfig
from checkpoints.weights import Declaration

SLIDING, FULL = "sliding_attention", "full_attention"
PATTERN = 6  # every sixth layer is global, when a config does not list its layer types
LOCAL_THETA = 10000.0

# Gemma's turn format; a base model's GGUF carries no template, and its users chat the same way.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set first = 0 %}{% set system = '' %}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\\n\\n' %}"
    "{% set first = 1 %}{% endif %}"
    "{% for message in messages[first:] %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if loop.first %}{{ system }}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def default_layer_types(num_layers: int, pattern: int = PATTERN) -> tuple[str, ...]:
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def weights(config: ModelConfig) -> Declaration:
    norms = {
        "attn_norm": blocks.norm(config, "input_layernorm", "attn_norm"),
        "post_attn_norm": blocks.norm(config, "post_attention_layernorm", "post_attention_norm"),
        "mlp_norm": blocks.norm(config, "pre_feedforward_layernorm", "ffn_norm"),
        "post_mlp_norm": blocks.norm(config, "post_feedforward_layernorm", "post_ffw_norm"),
    }
    return blocks.decoder(config, norms, blocks.dense_mlp(config))


def _gemma_fields() -> dict[str, Any]:
    return {"qk_norm": True, "post_norms": True, "hidden_act": "gelu_tanh", "scale_embeddings": True}


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"Gemma 3 with {key} is not supported")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with hidden_activation {hf['hidden_activation']!r} is not supported")
    params = hf.get("rope_parameters") or {}
    theta, scaling = rope(params.get(FULL), hf, default_theta=1_000_000.0)
    local_theta, local_scaling = rope(params.get(SLIDING), {"rope_theta": hf.get("rope_local_base_freq", LOCAL_THETA)})
    if local_scaling is not None:
        raise ValueError("Gemma 3 with scaled RoPE on its sliding layers is not supported")
    layer_types = hf.get("layer_types") or default_layer_types(
        hf["num_hidden_layers"], hf.get("sliding_window_pattern", PATTERN)
    )
    return {
        **common_fields(hf, "gemma3"),
        **_gemma_fields(),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_local_theta": local_theta,
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
        "sliding_window": hf.get("sliding_window", 4096),
        "layer_types": tuple(layer_types),
    }


def to_hf(config: ModelConfig) -> dict[str, Any]:
    d = common_hf(config, "Gemma3ForCausalLM")
    d.pop("use_sliding_window", None)
    return {
        **d,
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": config.rope_local_theta,
        "query_pre_attn_scalar": _number(config.query_pre_attn_scalar),
        "layer_types": list(config.layer_types or ()),
    }


def _number(x: float | None) -> float | int | None:
    """An integral float as an int (transformers' Gemma 3 config wants an int scalar)."""
    return int(x) if x is not None and float(x).is_integer() else x


def from_gguf(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    layers = int(meta[f"{arch}.block_count"])
    head_dim = int(meta[f"{arch}.attention.key_length"])
    return {
        **_gemma_fields(),
        "query_pre_attn_scalar": float(head_dim),
        "sliding_window": int(meta[f"{arch}.attention.sliding_window"]),
        "layer_types": default_layer_types(layers),
        "rope_local_theta": float(meta.get(f"{arch}.rope.freq_base_swa", LOCAL_THETA)),
    }


def _is_norm(path: str) -> bool:
    return path.endswith("norm/scale")


def from_hf_tensor(path: str, array: np.ndarray) -> np.ndarray:
    return array + np.float32(1.0) if _is_norm(path) else array


def to_hf_tensor(path: str, array: np.ndarray) -> np.ndarray:
    return array - np.float32(1.0) if _is_norm(path) else array


ARCHITECTURE = Architecture(
    "gemma3",
    "Gemma3ForCausalLM",
    weights,
    from_hf,
    to_hf,
    from_gguf=from_gguf,
    gguf_name="gemma3",
    from_hf_tensor=from_hf_tensor,
    to_hf_tensor=to_hf_tensor,
    chat_template=CHAT_TEMPLATE,
    end_of_turn="<end_of_turn>",
    hf_model_type="gemma3_text",
)
