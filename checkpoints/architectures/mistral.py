"""Mistral: Llama's layer with sliding-window attention in every layer (Mistral 7B v0.1's 4,096
tokens; later versions have no window). GGUF files of Mistral models say `llama`."""

from __future__ import annotations

from typing import Any

from checkpoints.architectures import llama
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.hf_config import common_fields, common_hf, sliding_window
from checkpoints.config import ModelConfig


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {**common_fields(hf, "mistral"), "sliding_window": sliding_window(hf, default_on=True)}


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return common_hf(config, "MistralForCausalLM")


ARCHITECTURE = Architecture("mistral", "MistralForCausalLM", llama.weights, from_hf, to_hf)
