"""Qwen2 / Qwen2.5: Llama's layer with biases on the q, k and v projections. llama.cpp does not
permute its Q/K rows."""

from __future__ import annotations

from typing import Any

from checkpoints.architectures import llama
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.hf_config import common_fields, common_hf, sliding_window
from checkpoints.config import ModelConfig


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {
        **common_fields(hf, "qwen2"),
        "attention_bias": bool(hf.get("attention_bias", True)),
        "sliding_window": sliding_window(hf, default_on=False),
    }


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return common_hf(config, "Qwen2ForCausalLM")


ARCHITECTURE = Architecture(
    "qwen2",
    "Qwen2ForCausalLM",
    llama.weights,
    from_hf,
    to_hf,
    from_gguf=lambda *_: {"attention_bias": True},
    gguf_name="qwen2",
)
