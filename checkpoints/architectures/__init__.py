"""The model families: one module each, listed in `ARCHITECTURES` (see `base.py`).

A config names its family (`ModelConfig.architecture`); `declare(config)` is the declaration of
its parameters (`checkpoints.weights`), from which the loaders, the shardings and random
weights derive.
"""

from __future__ import annotations

from typing import Any

from checkpoints.architectures import (
    deepseek_v3,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
)
from checkpoints.architectures.base import Architecture
from checkpoints.config import ModelConfig
from checkpoints.weights import Declaration

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        llama.ARCHITECTURE,
        mistral.ARCHITECTURE,
        qwen2.ARCHITECTURE,
        qwen3.ARCHITECTURE,
        gemma3.ARCHITECTURE,
        mixtral.ARCHITECTURE,
        qwen3_moe.ARCHITECTURE,
        deepseek_v3.ARCHITECTURE,
        gpt_oss.ARCHITECTURE,
        qwen3_5.ARCHITECTURE,
        qwen3_next.ARCHITECTURE,
    )
}


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def declare(config: ModelConfig) -> Declaration:
    """The declared weights of a model of `config`."""
    return architecture(config.architecture).weights(config)


def from_model_type(model_type: str, hf_classes: list[str]) -> Architecture:
    """The family of a Hugging Face `config.json` by its `model_type`."""
    for arch in ARCHITECTURES.values():
        if arch.model_type == model_type:
            return arch
    supported = sorted(a.model_type for a in ARCHITECTURES.values())
    raise ValueError(f"unsupported architecture {model_type!r} ({hf_classes}); supported: {supported}")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a Hugging Face `config.json`."""
    arch = from_model_type(hf.get("model_type", "llama"), hf.get("architectures") or [])
    return ModelConfig(**arch.from_hf(hf))


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The `config.json` of a ModelConfig, which `config_from_hf` (and transformers) reads back."""
    return architecture(config.architecture).to_hf(config)


def from_gguf_name(name: str | None) -> Architecture | None:
    """The family of a GGUF file's `general.architecture`, or None."""
    return next((a for a in ARCHITECTURES.values() if a.gguf_name is not None and a.gguf_name == name), None)


def gguf_names() -> list[str]:
    return sorted(a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name is not None)
