"""Qwen3-MoE: Qwen3's attention (q/k norms) with a mixture-of-experts MLP in every layer: softmax
over all experts, top-k, renormalised only when `norm_topk_prob`. No shared expert. Configs with
dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused."""

from __future__ import annotations

from typing import Any

from checkpoints.architectures import blocks
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.hf_config import common_fields, common_hf, sliding_window
from checkpoints.config import ModelConfig
from checkpoints.weights import Declaration


def weights(config: ModelConfig) -> Declaration:
    moe = blocks.experts(config, "mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")
    return blocks.decoder(config, blocks.llama_norms(config), moe)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step > 1) is not supported")
    return {
        **common_fields(hf, "qwen3_moe"),
        "qk_norm": True,
        "sliding_window": sliding_window(hf, default_on=False),
        "num_experts": hf["num_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
    }


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        **common_hf(config, "Qwen3MoeForCausalLM"),
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


ARCHITECTURE = Architecture("qwen3_moe", "Qwen3MoeForCausalLM", weights, from_hf, to_hf)
