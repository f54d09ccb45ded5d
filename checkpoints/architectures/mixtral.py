"""Mixtral: Mistral's attention with a mixture-of-experts MLP in every layer: a router picks the
top-k experts of each token (softmax over all experts, top-k, renormalised to sum to 1) and their
SwiGLU outputs are summed with those weights. No shared expert."""

from __future__ import annotations

from typing import Any

from checkpoints.architectures import blocks
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.hf_config import common_fields, common_hf
from checkpoints.config import ModelConfig
from checkpoints.weights import Declaration


def weights(config: ModelConfig) -> Declaration:
    moe = blocks.experts(config, "block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")
    return blocks.decoder(config, blocks.llama_norms(config), moe)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {
        **common_fields(hf, "mixtral"),
        "sliding_window": hf.get("sliding_window"),
        "num_experts": hf["num_local_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["intermediate_size"],
        "norm_topk_prob": True,
    }


def to_hf(config: ModelConfig) -> dict[str, Any]:
    d = common_hf(config, "MixtralForCausalLM")
    d.pop("use_sliding_window", None)
    return {
        **d,
        "sliding_window": config.sliding_window,
        "intermediate_size": config.moe_intermediate_size,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
    }


ARCHITECTURE = Architecture("mixtral", "MixtralForCausalLM", weights, from_hf, to_hf)
