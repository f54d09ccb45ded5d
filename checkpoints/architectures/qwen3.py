"""Qwen3: Llama's layer with an RMS norm on each query and key head before RoPE, no biases, and
a head size of its own (128, whatever the hidden size)."""

from __future__ import annotations

from typing import Any

from checkpoints.architectures import llama
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.hf_config import common_fields, common_hf, sliding_window
from checkpoints.config import ModelConfig


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {**common_fields(hf, "qwen3"), "qk_norm": True, "sliding_window": sliding_window(hf, default_on=False)}


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return common_hf(config, "Qwen3ForCausalLM")


ARCHITECTURE = Architecture(
    "qwen3",
    "Qwen3ForCausalLM",
    llama.weights,
    from_hf,
    to_hf,
    from_gguf=lambda *_: {"qk_norm": True},
    gguf_name="qwen3",
)
